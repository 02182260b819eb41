"""Scoring a document classifier (issue 47): accuracy, macro-F1 and the confusion matrix of a split, each
document read segment by segment with the memory (`txl.models.transformer_xl.classify`).

    scores = evaluate_classifier(model, corpus, "test", tgt_len=128)
    print(format_report(scores))           # accuracy, macro-F1, per-class F1, the confusion matrix

Macro-F1 is the unweighted mean of the per-class F1 over the classes (a class with no true and no predicted
document counts as F1 = 0 only if it occurs in the split's labels or predictions; classes absent from both
are left out, as scikit-learn's `labels=None` does).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from txl.data.documents import bucket_batches, collate
from txl.eval.precision import autocast
from txl.eval.result import EvalResult


@dataclass
class ClassificationScores:
    """What `txl eval` reports for a classifier (JSON: `to_dict`)."""

    split: str
    labels: list[str]
    documents: int
    accuracy: float
    macro_f1: float
    loss: float  # mean cross-entropy (nats) per document
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)  # label -> precision, recall, f1, support
    confusion: list[list[int]] = field(default_factory=list)  # [true][predicted]
    tokens: int = 0
    seconds: float = 0.0
    segments: str = "all"
    tgt_len: int = 0
    mem_len: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def as_eval_result(self, metric: str = "ppl") -> EvalResult:
        """The trainer's view: the loss per document, accuracy beside it."""
        return EvalResult(loss=self.loss, tokens=self.tokens, seconds=self.seconds, metric=metric, mem_len=self.mem_len,
                          tgt_len=self.tgt_len, batch_size=0, warm_memory=False, split=self.split,
                          accuracy=self.accuracy, mode="classify")


def confusion_matrix(truth: list[int], predicted: list[int], n_labels: int) -> list[list[int]]:
    """counts[t][p]: documents of class t predicted as p."""
    counts = [[0] * n_labels for _ in range(n_labels)]
    for t, p in zip(truth, predicted):
        counts[t][p] += 1
    return counts


def scores_from_confusion(confusion: list[list[int]], labels: list[str]) -> tuple[float, float, dict]:
    """(accuracy, macro-F1, per-class precision/recall/F1/support) of a confusion matrix."""
    n = len(labels)
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(n))
    per_class: dict[str, dict[str, float]] = {}
    f1s = []
    for i, name in enumerate(labels):
        tp = confusion[i][i]
        support = sum(confusion[i])
        predicted = sum(confusion[t][i] for t in range(n))
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[name] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
        if support or predicted:
            f1s.append(f1)
    return (correct / total if total else math.nan), (sum(f1s) / len(f1s) if f1s else math.nan), per_class


@torch.no_grad()
def evaluate_classifier(model, corpus, split: str, *, tgt_len: int, batch_size: int = 16, segments: str | None = None,
                        mem_len: int | None = None, device=None, precision: str = "fp32",
                        max_documents: int = 0) -> ClassificationScores:
    """Classify every labelled document of `split` (the first `max_documents` when > 0)."""
    start = time.perf_counter()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    segments = segments or model.config.classifier_segments
    ids, targets = corpus.documents(split)
    rows = [i for i, t in enumerate(targets) if t >= 0]
    if max_documents:
        rows = rows[:max_documents]
    lengths = [min(len(ids[i]), tgt_len) if segments == "first" else len(ids[i]) for i in range(len(ids))]
    was_training = model.training
    model.eval()
    truth: list[int] = []
    predicted: list[int] = []
    nll, tokens = 0.0, 0
    try:
        for group in bucket_batches(lengths, tgt_len=tgt_len, batch_size=batch_size, order=rows):
            batch = collate(ids, targets, group, max_len=tgt_len if segments == "first" else 0)
            with autocast(device, precision):
                out = model.classify(batch.input_ids.to(device), lengths=batch.lengths, tgt_len=tgt_len,
                                     segments=segments, mem_len=mem_len)
            logits = out.logits.float()
            labels = batch.labels.to(device)
            nll += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            truth += batch.labels.tolist()
            predicted += logits.argmax(-1).tolist()
            tokens += out.tokens
    finally:
        model.train(was_training)
    labels = list(corpus.labels)
    confusion = confusion_matrix(truth, predicted, len(labels))
    accuracy, macro_f1, per_class = scores_from_confusion(confusion, labels)
    return ClassificationScores(
        split=split, labels=labels, documents=len(truth), accuracy=accuracy, macro_f1=macro_f1,
        loss=nll / len(truth) if truth else math.nan, per_class=per_class, confusion=confusion, tokens=tokens,
        seconds=time.perf_counter() - start, segments=segments, tgt_len=tgt_len,
        mem_len=model.mem_len if mem_len is None else mem_len)


def format_report(scores: ClassificationScores) -> str:
    """Accuracy and macro-F1, per-class precision/recall/F1, and the confusion matrix (rows: true label,
    columns: predicted) as a plain-text table."""
    labels = scores.labels
    lines = [f"{scores.split}: {scores.documents:,} documents, accuracy {scores.accuracy:.4f}, macro-F1 "
             f"{scores.macro_f1:.4f}, loss {scores.loss:.4f} (reading {'the first segment' if scores.segments == 'first' else 'every segment with memory'}, "
             f"tgt_len {scores.tgt_len}, mem_len {scores.mem_len})"]
    width = max([len(x) for x in labels] + [5])
    lines.append(f"  {'label':<{width}}  precision  recall      f1  support")
    for name in labels:
        c = scores.per_class[name]
        lines.append(f"  {name:<{width}}  {c['precision']:9.4f}  {c['recall']:6.4f}  {c['f1']:6.4f}  {int(c['support']):7d}")
    cell = max([len(x) for x in labels] + [len(str(max(map(max, scores.confusion), default=0))), 4])
    lines.append("confusion (rows: true, columns: predicted)")
    lines.append("  " + " " * width + "  " + " ".join(f"{x:>{cell}}" for x in labels))
    for name, row in zip(labels, scores.confusion):
        lines.append(f"  {name:<{width}}  " + " ".join(f"{v:>{cell}}" for v in row))
    return "\n".join(lines)
