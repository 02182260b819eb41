"""The Style Transformer's measures (`txl.eval.style`): the Kneser-Ney trigram is a distribution, self-BLEU is
BLEU-4 as Papineni et al. define it, the classifier learns a separable pair of styles and leaves the caller's
random state alone, and `score_style_transfer` scores every direction beside the copy baseline."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from txl.eval.style import KneserNey, features, hash_gram, self_bleu, train_classifier

SENTENCES = [s.split() for s in ["the cat sat on the mat", "the dog sat on the log", "a cat saw the dog",
                                 "the mat was red", "a dog ran"]]


@pytest.mark.parametrize("context", [("<s>", "<s>"), ("the", "cat"), ("sat", "on"), ("on", "the"),
                                     ("cat", "the"), ("zebra", "mat"), ("zebra", "quagga")])
def test_kneser_ney_sums_to_one_over_its_words_and_one_unseen_word(context):
    """Every order discounts into the next, and the unigram floor keeps a uniform share for a word it never saw:
    the probabilities of every known word (</s> included) and one unseen word sum to 1, whatever the context."""
    lm = KneserNey(SENTENCES)
    words = sorted(lm.vocab) + ["never-seen"]
    assert math.isclose(sum(lm.prob(*context, w) for w in words), 1.0, rel_tol=1e-12)


def test_kneser_ney_prefers_seen_continuations_and_scores_its_own_text_better():
    lm = KneserNey(SENTENCES)
    assert lm.prob("on", "the", "mat") > lm.prob("on", "the", "red") > 0
    assert lm.perplexity(SENTENCES) < lm.perplexity([s[::-1] for s in SENTENCES])


def _bleu4(hyps, refs):
    """BLEU-4 written out: clipped n-gram precisions over the corpus, their geometric mean, the brevity penalty."""
    logs = []
    for n in range(1, 5):
        match = total = 0
        for h, r in zip(hyps, refs):
            hc = Counter(tuple(h[i: i + n]) for i in range(len(h) - n + 1))
            rc = Counter(tuple(r[i: i + n]) for i in range(len(r) - n + 1))
            match += sum(min(c, rc[g]) for g, c in hc.items())
            total += max(len(h) - n + 1, 0)
        logs.append(math.log(match / total))
    c, r = sum(map(len, hyps)), sum(map(len, refs))
    return 100 * min(1.0, math.exp(1 - r / c)) * math.exp(sum(logs) / 4)


def test_self_bleu_is_corpus_bleu_4_with_the_brevity_penalty():
    pytest.importorskip("sacrebleu")
    hyps = [s.split() for s in ["the cat sat on the mat today", "a dog ran far away"]]
    refs = [s.split() for s in ["the cat sat on a mat today", "a dog ran far away from home"]]
    assert self_bleu(hyps, refs) == pytest.approx(_bleu4(hyps, refs), rel=1e-9)
    assert self_bleu(refs, refs) == 100.0
    assert self_bleu([["x", "y", "z", "w"]], [["a", "b", "c", "d"]]) == 0.0
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        self_bleu(hyps, refs[:1])


def test_features_hash_unigrams_and_bigrams_stably():
    assert hash_gram("a") == 0xE40C292C  # FNV-1a 32-bit of b"a"
    assert features(["to", "be"], 1 << 18) == [hash_gram(g) % (1 << 18) for g in ("to", "be", "to be")]
    assert features([], 8) == [0]


def test_the_classifier_learns_two_separable_styles_and_leaves_the_random_state_alone():
    verse = [["thee", "thou", "art", f"w{i}"] for i in range(40)]
    news = [["shares", "million", "said", f"w{i}"] for i in range(40)]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    predict = train_classifier(verse + news, [0] * 40 + [1] * 40, 2, seed=0, epochs=5)
    assert torch.equal(torch.get_rng_state(), before)
    assert predict([["thou", "art", "new"], ["shares", "said", "new"]]) == [0, 1]
    again = train_classifier(verse + news, [0] * 40 + [1] * 40, 2, seed=0, epochs=5)
    mixed = [["thou", "said", "x"], ["art", "million"], ["w3"]]
    assert predict(mixed) == again(mixed)  # seeded: the same classifier


def test_without_sacrebleu_self_bleu_is_left_out_and_the_table_says_so(monkeypatch):
    import txl.eval.style as style

    monkeypatch.setattr(style, "bleu_available", lambda: False)
    assert style.self_bleu([["a"]], [["a"]]) is None
    row = {"from": "a", "to": "b", "system": style.MODEL, "sentences": 1, "style_accuracy": 0.5, "self_bleu": None,
           "target_lm_ppl": 12.0}
    assert style.rows_table({"rows": [row]}).splitlines()[-1] == "| a -> b | style transformer | 1 | 50.0% | - | 12.0 |"
