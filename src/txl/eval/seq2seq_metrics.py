"""Scores of generated targets against references: exact match, ROUGE-1/2/L (Lin 2004).

ROUGE comes from Google's `rouge-score` package (the implementation the summarisation literature
reports; optional: `pip install 'txl[seq2seq]'`), F-measure, with Porter stemming. Token accuracy is a
teacher-forced score and lives in `txl.eval.seq2seq`.
"""

from __future__ import annotations

from collections.abc import Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of hypotheses equal to their reference (surrounding whitespace ignored)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        return float("nan")
    return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / len(references)


def rouge_available() -> bool:
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    return True


def rouge(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float] | None:
    """Mean ROUGE-1/2/L F-measures in [0, 1]; None without the optional `rouge-score` package."""
    if not rouge_available():
        return None
    from rouge_score import rouge_scorer

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for hyp, ref in zip(hypotheses, references):
        scores = scorer.score(ref, hyp)
        for name in ROUGE_TYPES:
            totals[name] += scores[name].fmeasure
    n = max(len(references), 1)
    return {name: total / n for name, total in totals.items()}
