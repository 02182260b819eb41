"""The result of an evaluation (`EvalResult`) and the numbers read from it: bpc or perplexity from a mean
loss (`metric_value`), and the attention length of a setting (`attention_length`). A leaf: training,
serving and every evaluator import it without loading a model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class EvalResult:
    loss: float  # mean NLL in nats per scored token
    tokens: int  # tokens scored
    seconds: float
    metric: str  # "bpc" or "ppl"
    mem_len: int
    tgt_len: int
    batch_size: int
    warm_memory: bool
    clamp_len: int | None = None  # None: not recorded (the model's own setting)
    same_length: bool | None = None
    mode: str = "xl"  # "xl": segments with memory; "vanilla": one fresh window per scored token
    attn_len: int | None = None  # keys the last query of a segment attends to (see `attention_length`)
    stride: int | None = None  # vanilla: positions scored per window
    split: str | None = None
    accuracy: float | None = None  # mlm: share of masked tokens whose argmax prediction is the original
    mask_prob: float | None = None  # mlm: positions picked per window
    dynamic_lr: float | None = None  # dynamic evaluation (txl.eval.dynamic): SGD step size η ...
    dynamic_decay: float | None = None  # ... and decay λ toward the trained weights

    @property
    def value(self) -> float:
        return metric_value(self.loss, self.metric)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        out = asdict(self)
        out[self.metric] = self.value
        out["tokens_per_second"] = self.tokens_per_second
        return out


def metric_value(loss: float, metric: str) -> float:
    """bpc = nats / ln 2 (bits per byte or character token); ppl = exp(nats)."""
    if metric == "bpc":
        return loss / math.log(2)
    return math.exp(min(loss, 700.0))


def attention_length(*, mem_len: int, tgt_len: int, same_length: bool) -> int:
    """Keys the *last* query of a segment attends to at each layer: mem_len + tgt_len (the first query
    sees mem_len + 1), or exactly mem_len with same_length. The x-axis of `--sweep-mem`."""
    return mem_len if same_length else mem_len + tgt_len
