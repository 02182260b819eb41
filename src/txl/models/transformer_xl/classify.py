"""Long-document classification with the Transformer-XL memory (issue 47; kimiyoung/transformer-xl #22, #31,
#117; Hugging Face's `TransfoXLForSequenceClassification`).

A document longer than one segment is read segment by segment, the memory carrying the earlier segments
into each later one (as the LM reads a stream), and classified from the final hidden states of its *last*
segment: their mean over the real tokens (`classifier_pooling="mean"`), the last real token's
(`"last"`; HF's choice), or those of a learned summary token appended after the last real token (`"summary"`,
a [CLS] at the end: under causal attention only the end sees the whole segment). `classifier_segments="first"` reads the first segment alone: the baseline of a
fixed-context classifier, which cannot see anything past `tgt_len` tokens.

Batching documents of different lengths: the rows of one call have the same number of segments
(`ceil(length / tgt_len)`; `txl.data.documents.DocumentBatches` buckets them so). Every segment but the
last is then full in every row, and only the last is right-padded: with causal attention a real token
never attends to a later position, so each row's pooled states are exactly what the document gets alone
(tested), with no padding inside the memory.

The model is the decoder (`TransformerXL`, its LM head kept, so `--init-from` an LM run copies every LM
weight) plus `classifier`, a `Linear(d_model, num_labels)`; `txl.models.registry` builds it when
`config.num_labels > 0`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import UsageError
from txl.models.transformer_xl.model import TransformerXL


@dataclass
class ClassifierOutput:
    """logits: (b, num_labels); loss: mean cross-entropy over the rows whose label is not -100 (None without
    labels); pooled: (b, d_model) the pooled final hidden states; tokens: the real tokens read."""

    logits: Tensor
    loss: Tensor | None
    pooled: Tensor
    tokens: int


def segment_count(length: int, tgt_len: int, segments: str = "all") -> int:
    """Segments a document of `length` tokens is read in: ceil(length / tgt_len), or 1 for `first`."""
    return 1 if segments == "first" else max(-(-length // tgt_len), 1)


class TransformerXLClassifier(TransformerXL):
    """`TransformerXL` with a sequence-classification head: `model.classify(input_ids, lengths=..., tgt_len=...)`.
    `model(...)` stays the language model."""

    def __init__(self, config):
        super().__init__(config)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        # pooling "summary": the input embedding of the token appended after each document's last real token
        self.summary = nn.Parameter(torch.empty(config.d_model)) if config.classifier_pooling == "summary" else None
        self._summary_at: Tensor | None = None  # (b, t) where `_embed` puts it during `classify`
        self._reset_classifier()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "classifier"):  # (the base constructor calls this before the head exists)
            self._reset_classifier()

    def _reset_classifier(self) -> None:
        nn.init.normal_(self.classifier.weight, 0.0, self.config.init_std)
        nn.init.zeros_(self.classifier.bias)
        if self.summary is not None:
            nn.init.normal_(self.summary, 0.0, self.config.init_std)

    def _embed(self, input_ids: Tensor) -> Tensor:
        h = super()._embed(input_ids)  # (b, t, d_model)
        if self._summary_at is None:
            return h
        return torch.where(self._summary_at[..., None], self.summary.to(h.dtype), h)

    def classify(self, input_ids: Tensor, *, lengths: Tensor | None = None, labels: Tensor | None = None,
                 tgt_len: int, segments: str | None = None, pooling: str | None = None,
                 mem_len: int | None = None) -> ClassifierOutput:
        """input_ids: (b, n) right-padded documents; lengths: (b,) their real lengths (None: all n), whose
        segment counts at `tgt_len` must be equal. labels: (b,) class ids (-100: not scored). segments /
        pooling: this call's choice (default: the config's); mem_len: this call's memory length."""
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if tgt_len < 1:
            raise UsageError(f"tgt_len must be >= 1, got {tgt_len}")
        segments = segments or self.config.classifier_segments
        pooling = pooling or self.config.classifier_pooling
        batch, width = input_ids.shape
        if lengths is None:
            lengths = torch.full((batch,), width, dtype=torch.long, device=input_ids.device)
        lengths = lengths.to(input_ids.device)
        if segments == "first":
            lengths = lengths.clamp(max=tgt_len)
        if int(lengths.min()) < 1 or int(lengths.max()) > width:
            raise UsageError(f"lengths must be within 1..{width} (the padded width)")
        counts = {segment_count(int(n), tgt_len) for n in lengths.tolist()}
        if len(counts) != 1:
            raise UsageError(f"the rows of one call must have the same number of segments at tgt_len={tgt_len}, got "
                             f"{sorted(counts)}; bucket documents by segment count (txl.data.documents.DocumentBatches)")
        if pooling == "summary" and self.summary is None:
            raise UsageError("pooling='summary' needs a model built with classifier_pooling='summary' (its learned token)")
        n_segments = counts.pop()
        real = lengths - (n_segments - 1) * tgt_len  # (b,) real tokens of the last segment, >= 1
        memory = None
        for s in range(n_segments):  # every segment but the last is full in every row
            start = s * tgt_len
            last = s == n_segments - 1
            stop = int(lengths.max()) if last else start + tgt_len
            segment = input_ids[:, start:stop]
            if last and pooling == "summary":  # one more position: the summary token right after the real ones
                segment = torch.cat([segment, segment.new_zeros(batch, 1)], dim=1)
                self._summary_at = torch.arange(segment.shape[1], device=segment.device)[None, :] == real[:, None]
            try:
                out = self(segment, memory=memory, return_logits=False, mem_len=0 if segments == "first" else mem_len)
            finally:
                self._summary_at = None
            memory = out.memory
        hidden = out.hidden  # (b, t_last, d_model): the last segment's final hidden states
        if pooling == "summary":
            pooled = hidden[torch.arange(batch, device=hidden.device), real]  # (b, d_model)
        elif pooling == "last":
            pooled = hidden[torch.arange(batch, device=hidden.device), real - 1]  # (b, d_model)
        else:
            keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < real[:, None]  # (b, t_last)
            pooled = (hidden * keep[..., None].to(hidden.dtype)).sum(1) / real[:, None].to(hidden.dtype)
        logits = self.classifier(pooled)  # (b, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels.to(logits.device), ignore_index=-100)
        return ClassifierOutput(logits=logits, loss=loss, pooled=pooled, tokens=int(lengths.sum()))
