"""Hugging Face TransfoXL tokenizers and checkpoints built by the tests (transformers==4.35.2)."""

from __future__ import annotations

import pickle
from collections import Counter, OrderedDict
from pathlib import Path

import torch

SPECIAL = ["<eos>", "<unk>", "<formula>"]
# A small WikiText-103-like vocabulary: punctuation, number pieces, hyphen/number joiners, a few words.
WORDS = [
    "the", ",", ".", "of", "and", "in", "to", "a", "was", "The", "@-@", "@,@", "@.@", "1", "2", "3", "000", "80",
    "23", "5", "is", "he", "'s", "1990", '"', "(", ")", ";", ":", "'", "n't", "year", "time", "state", "art",
    "people", "tall", "m", "said", "I", "do", "know", "hello", "world", "Hello", "!", "?", "$", "%", "twice", "He",
    "It", "it", "U.S.", "New", "York", "city", "10", "100", "--", "–", "km", "long", "ΑΧΙΛΛΕΥΣ", "αχιλλευσ",
]

SENTENCES = [
    "Hello, world! The year 1990 was 23,000 people's state-of-the-art time.",
    'He said "hello" (twice) -- I don\'t know; it was 1.80 m tall.',
    "The city of New York is 5,000.5 km long: $ 100 and 10 % of it.",
    "Zyzzyva frobnicates the quux, unknowable words become <unk>.",
    "It was a   spaced\ttab line   ",
    "The U.S. state-of-the-art, 2–3 people?",
    "The inscription in Greek reads: ΑΧΙΛΛΕΥΣ, “curly” quotes… and <formula> mid<unk>word <UNK>.",
]


def build_tokenizer(lower_case: bool = False):
    from transformers import TransfoXLTokenizer

    tok = TransfoXLTokenizer(special=list(SPECIAL), lower_case=lower_case)
    counts = Counter()
    for rank, word in enumerate(WORDS):
        counts[word] = len(WORDS) - rank  # a fixed, frequency-like order
    tok.counter.update(counts)
    tok.build_vocab()
    return tok


def save_hf_model(directory: Path, vocab_size: int, *, seed: int = 0, **overrides) -> None:
    """A random TransfoXLLMHeadModel of `vocab_size` words saved (safetensors) into `directory`."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    config = dict(vocab_size=vocab_size, d_model=32, d_embed=32, n_head=4, d_head=8, d_inner=64, n_layer=2,
                  mem_len=16, tgt_len=8, clamp_len=-1, dropout=0.0, dropatt=0.0, cutoffs=[20, 40], div_val=2,
                  same_length=False, untie_r=True)
    config.update(overrides)
    torch.manual_seed(seed)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)


def old_layout_state(tok) -> dict:
    """The plain dict the pytorch-pretrained-bert tokenizer pickled (no regexes, no Moses objects)."""
    return {
        "special": list(tok.special), "min_freq": 0, "max_size": None, "lower_case": tok.lower_case,
        "delimiter": None, "vocab_file": None, "never_split": ("<unk>", "<eos>", "<formula>"),
        "counter": Counter(tok.counter), "idx2sym": list(tok.idx2sym), "sym2idx": OrderedDict(tok.sym2idx),
        "eos_idx": tok.sym2idx["<eos>"], "unk_idx": tok.sym2idx["<unk>"],
    }


def write_old_layout(path: Path, tok, protocol: int = 2) -> None:
    path.write_bytes(pickle.dumps(old_layout_state(tok), protocol=protocol))
