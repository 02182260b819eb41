"""Writes tests/data/hf_added_tokens/: a TransfoXL folder saved by transformers 4.35.2 whose tokenizer added a
token beyond its vocab.pkl (issue 50). Run from the repository root: `python tests/data/make_hf_added_tokens.py`.

The tokenizer is built the way the reference code's vocabularies were (a vocab file of symbols, here the
project's own small word list from tests/hf_fixtures.py, with <eos> and <unk> but no <formula>), so
`TransfoXLTokenizer` adds its default additional special token `<formula>` after the vocabulary (id 67).
`save_pretrained` then writes vocab.pkl (67 symbols), added_tokens.json ({"<formula>": 67}) and
tokenizer_config.json (whose `added_tokens_decoder` lists it too), and the model's config.json counts it
(vocab_size 68). expected.json holds the ids the reloaded `TransfoXLTokenizer` gives the test sentences.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import hf_fixtures as F  # noqa: E402

OUT = HERE / "hf_added_tokens"
SENTENCES = [
    "The city of <formula> is 5,000 km long.",
    "He said mid<formula>word and <formula><formula> twice; <unk> <eos> x<eos>y.",
    "Hello, world! The year 1990 was 23,000 people's state-of-the-art time.",
]


def main() -> None:
    import transformers
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLTokenizer

    assert transformers.__version__ == "4.35.2", transformers.__version__
    OUT.mkdir(exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # the tokenizer records its vocab file's path: keep it relative
        try:
            Path("vocab.txt").write_text("\n".join(["<eos>", "<unk>", *F.WORDS]) + "\n", encoding="utf-8")
            tokenizer = TransfoXLTokenizer(vocab_file="vocab.txt")
        finally:
            os.chdir(cwd)
    assert len(tokenizer.idx2sym) == 67 and tokenizer.added_tokens_encoder["<formula>"] == 67 and len(tokenizer) == 68
    tokenizer.save_pretrained(str(OUT))

    config = TransfoXLConfig(vocab_size=len(tokenizer), d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=32,
                             n_layer=1, mem_len=8, tgt_len=8, clamp_len=-1, dropout=0.0, dropatt=0.0, cutoffs=[20, 40],
                             div_val=2, same_length=False, untie_r=True)
    torch.manual_seed(0)
    model = TransfoXLLMHeadModel(config).eval()
    model.save_pretrained(str(OUT))  # model.safetensors + config.json

    reloaded = TransfoXLTokenizer.from_pretrained(str(OUT))  # how a user loads the folder
    expected = {sentence: reloaded.encode(sentence) for sentence in SENTENCES}
    assert all(tokenizer.encode(s) == ids for s, ids in expected.items())
    rows = ",\n".join(f"  {json.dumps(s, ensure_ascii=False)}: {json.dumps(ids)}" for s, ids in expected.items())
    text = f'{{"transformers": "{transformers.__version__}", "ids": {{\n{rows}\n}}}}\n'
    (OUT / "expected.json").write_text(text, encoding="utf-8")
    for path in sorted(OUT.iterdir()):
        print(f"{path.stat().st_size:>8,}  {path}")


if __name__ == "__main__":
    main()
