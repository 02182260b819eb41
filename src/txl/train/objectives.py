"""What a run trains for: each objective owns its corpus, its batches, its step and its evaluation.

- `LanguageModelling` (train.objective = "lm"): next-token prediction over a token stream, with the
  model's memory carried from segment to segment (one memory per micro-batch, dropped at an epoch's start
  and after a non-finite step);
- `MaskedLanguageModelling` ("mlm"): BERT's 80/10/10 masking of each segment for the bidirectional
  encoder; only the masked positions are scored;
- `SequenceToSequence` (a pair corpus: pairs:, reverse, pydoc-summaries): teacher forcing of an
  encoder-decoder over length-bucketed pair batches, label smoothing in the minimised loss;
- `Classification` ("classify"): a `docs:` collection's documents read segment by segment with the memory
  and classified from the last segment (issue 47).

The trainer (`txl.train.loop`) asks its objective for a step and a score and never which one it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from txl.data.masking import mask_tokens
from txl.errors import ConfigError, DataError
from txl.eval.mlm import evaluate_mlm
from txl.eval.precision import autocast
from txl.eval.result import EvalResult
from txl.eval.segments import evaluate
from txl.nn.memory import Memory


class LanguageModelling:
    """Next-token prediction with memory (the reference's training)."""

    name = "lm"
    writes_sample = True  # the end of the run continues a prompt

    def __init__(self, cfg, corpus, dist, *, vocab_size: int, precision: str, scaler, ddp):
        self.cfg, self.corpus, self.dist = cfg, corpus, dist
        self.vocab_size, self.precision, self.scaler, self.ddp = vocab_size, precision, scaler, ddp
        self.memories: list[Memory | None] = [None] * cfg.grad_accum  # one per micro-batch
        self.ponder_depth = None  # universal: the last micro-batch's average depth (ACT)
        self._checked_splits: set[str] = set()

    # -- what the run is built from ----------------------------------------------------------------
    @staticmethod
    def open_corpus(spec: str, *, vocab=None):
        from txl.data import open_corpus, parse_spec

        if parse_spec(spec).name == "docs":  # a document collection as a stream that knows its documents
            from txl.data.document_stream import open_document_stream

            return open_document_stream(spec, vocab=vocab)
        return open_corpus(spec, vocab=vocab)

    @staticmethod
    def model_config(config, corpus, data: str):
        from txl.models.registry import is_seq2seq

        if is_seq2seq(config):
            raise ConfigError(f"model.arch={config.arch!r} trains on a pair corpus (pairs:, reverse, "
                              f"pydoc-summaries), not {data!r}; pick one with --data")
        if config.arch == "style-transformer":
            raise ConfigError(f"model.arch='style-transformer' trains on sentences of two styles, not {data!r}: give "
                              "them with --data style:A_FILE,B_FILE (one style per file, one sentence per line)")
        return config

    def batches(self):
        from txl.data import StreamIterator
        from txl.data.iterators import ShuffledSentenceIterator

        cfg = self.cfg
        documents = self.documents("train")
        if documents is not None:  # documents in a random order per epoch; a row's memory resets between them
            return ShuffledSentenceIterator(self.corpus.split("train"), documents, cfg.batch_size, cfg.tgt_len,
                                            shuffle=True, seed=cfg.seed, boundaries=True)
        return StreamIterator(self.corpus.split("train"), batch_size=cfg.batch_size, tgt_len=cfg.tgt_len,
                              varlen=cfg.varlen, roll=cfg.roll, seed=cfg.seed)

    def documents(self, split: str):
        """The document offsets of `split` with `train.document_boundaries` (issue 47), else None: where the
        corpus records its documents' starts (lm1b's sentences in the prepared cache)."""
        if not getattr(self.cfg, "document_boundaries", False):
            return None
        find = getattr(self.corpus, "sentence_offsets", None)
        offsets = None if find is None else find(split)
        if offsets is None:
            raise ConfigError(f"train.document_boundaries=true needs a corpus that records where its documents "
                              f"start (lm1b's sentences); {self.cfg.data!r} records none: set it to false")
        return offsets

    # -- one step ----------------------------------------------------------------------------------
    def forget(self) -> None:
        """Drop the carried memory (an epoch's start; a non-finite step must not carry NaNs on)."""
        self.memories = [None] * self.cfg.grad_accum

    def check_batch(self, batch) -> None:
        # inputs[:, 1:] == targets[:, :-1]: the targets and the first column cover every id
        self.check_token_ids(max(int(batch.targets.max()), int(batch.inputs[:, 0].max())), "train")
        if batch.step == 0:
            self.forget()  # memory does not cross epochs

    def tokens(self, batch, scored: int) -> int:
        """Tokens the step processed over all ranks (not only the scored ones)."""
        return self.cfg.batch_size * batch.inputs.shape[1]

    def mask(self, inputs, targets):
        """(inputs, targets, scored count or None): a language model scores every position."""
        return inputs, targets, None

    def step(self, forward: Callable, batch) -> tuple[float, int]:
        """Forward/backward over this rank's micro-batches. Returns (summed NLL over this rank's scored
        tokens, their count); the NLL is NaN when any micro-batch loss was not finite. One host sync."""
        cfg, device = self.cfg, self.dist.device
        rows = self.dist.rows(cfg.batch_size)
        inputs, targets, scored = self.mask(batch.inputs[rows], batch.targets[rows])
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        padding, reset = None, None
        if batch.reset is not None:  # documents (train.document_boundaries): padding after a document's end
            padding = batch.attention_mask[rows].to(device, non_blocking=True)
            reset = batch.reset[rows].to(device, non_blocking=True)
            targets = targets.masked_fill(padding == 0, -100)
            scored = int(batch.score_mask[rows].sum()) if scored is None else scored
        micro = inputs.shape[0] // cfg.grad_accum
        nll_sum = torch.zeros((), dtype=torch.float64, device=device)
        for j in range(cfg.grad_accum):
            part = slice(j * micro, (j + 1) * micro)
            x, y = inputs[part], targets[part]
            extra = {}
            if padding is not None:
                extra["attention_mask"] = padding[part]
                if self.memories[j] is not None:  # a row whose document ended reads its next one afresh
                    self.memories[j] = self.memories[j].reset(reset[part])
            with self._sync(last=j == cfg.grad_accum - 1):
                with autocast(device, self.precision):
                    out = forward(x, memory=self.memories[j], labels=y, **extra)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss  # compressive memory
                self.scaler.scale(loss / cfg.grad_accum).backward()
            self.memories[j] = out.memory
            self.ponder_depth = None if out.ponder_depth is None else out.ponder_depth.detach()  # universal
            # the loss, not the per-token NLL, decides finiteness (a caller may poison either)
            nll_sum += out.nll.detach().double().sum() + out.loss.detach().double() * 0
        return float(nll_sum), inputs.shape[0] * inputs.shape[1] if scored is None else scored

    def _sync(self, *, last: bool):
        """DDP: all-reduce the gradients on the last micro-batch only."""
        return contextlib.nullcontext() if last or self.dist.world == 1 else self.ddp.no_sync()

    # -- evaluation --------------------------------------------------------------------------------
    def check_token_ids(self, largest: int, split: str) -> None:
        """Prepared arrays are unsigned, so only an id >= vocab_size can be wrong (a damaged cache):
        without this it is an IndexError deep inside the embedding. Costs one max over the batch's
        B×T ids on the CPU per step, before they move to the device (about 0.02 ms for 22×512, 0.1 ms
        for 128×384: far below 0.1% of a step); the model forward itself is left alone."""
        if largest >= self.vocab_size:
            raise DataError(f"token id {largest} in the {split} split of {self.cfg.data!r} is outside the "
                            f"vocabulary ({self.vocab_size} ids): the prepared cache is damaged; "
                            f"run `txl data prepare {self.cfg.data} --force`")

    def _split_tokens(self, split: str, max_tokens: int):
        tokens = self.corpus.split(split)
        if split not in self._checked_splits and len(tokens):  # once per split: one pass over <= 5% of the corpus
            self.check_token_ids(int(tokens[: max_tokens + 1 if max_tokens else None].max()), split)
            self._checked_splits.add(split)
        return tokens

    def evaluate(self, model, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        """The split's loss with memory (every rank scores its rows; the totals are all-reduced)."""
        cfg, dist = self.cfg, self.dist
        tokens = self._split_tokens(split, max_tokens)
        bsz, rows = cfg.eval_batch_size, None
        if dist.world > 1:
            bsz = max(bsz // dist.world, 1) * dist.world
            rows = dist.rows(bsz)
        result = evaluate(
            model, tokens, metric=self.corpus.metric, batch_size=bsz, tgt_len=cfg.eval_tgt_len or cfg.tgt_len,
            mem_len=cfg.eval_mem_len, warm_memory=cfg.eval_warm_memory, max_tokens=max_tokens, device=dist.device,
            precision=self.precision, rows=rows, progress=progress, documents=self.documents(split),
        )
        if dist.world > 1:
            total, count = dist.all_sum([result.loss * result.tokens, result.tokens])
            result.loss, result.tokens = total / max(count, 1), int(count)
        result.split = split
        return result

    def final_extras(self, model, split: str) -> dict:
        """More scores of a final split, beyond `evaluate`'s (rank 0 only)."""
        return {}

    def next_commands(self, run: str) -> list[tuple[str, str]]:
        """What to do with the finished run (the summary's last lines): (command, what it does)."""
        held = "--split test; " if "test" in self.corpus.splits else ""
        return [(f"txl eval {run}", f"score it again ({held}--text FILE scores new text)"),
                (f"txl generate {run} --prompt TEXT", "continue a prompt (--num-samples, --stop, --json)"),
                (f"txl plot {run}", "training curves as a PNG"),
                (f"txl train --resume {run} --max-steps N", "train longer")]


class MaskedLanguageModelling(LanguageModelling):
    """BERT's masked LM for the bidirectional encoder (causal=false, no memory)."""

    name = "mlm"

    def mask(self, inputs, targets):
        # the global RNG: saved in checkpoints, so a resume is exact; labels = the original tokens, no shift
        vocab = self.vocab_size
        inputs, targets = mask_tokens(inputs, mask_id=vocab - 1, vocab_size=vocab, rate=self.cfg.mask_prob)
        return inputs, targets, int((targets != -100).sum())

    def evaluate(self, model, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        cfg, dist = self.cfg, self.dist
        tokens = self._split_tokens(split, max_tokens)
        result = evaluate_mlm(model, tokens, metric=self.corpus.metric, batch_size=cfg.eval_batch_size,
                              tgt_len=cfg.eval_tgt_len or cfg.tgt_len, mask_prob=cfg.mask_prob, seed=cfg.seed,
                              max_tokens=max_tokens, device=dist.device, precision=self.precision,
                              shard=(dist.rank, dist.world))
        if dist.world > 1:
            total, count, hits = dist.all_sum([result.loss * result.tokens, result.tokens,
                                               result.accuracy * result.tokens])
            result.loss, result.tokens, result.accuracy = total / max(count, 1), int(count), hits / max(count, 1)
        result.split = split
        return result

    def next_commands(self, run: str) -> list[tuple[str, str]]:
        steps = super().next_commands(run)
        steps.pop(1)  # an encoder generates no text
        return steps


class SequenceToSequence(LanguageModelling):
    """Teacher forcing of an encoder-decoder on a pair corpus (the decoder reads the target shifted right)."""

    name = "seq2seq"
    writes_sample = False  # its final splits are decoded instead

    @staticmethod
    def open_corpus(spec: str):
        from txl.data.seq2seq import open_pair_corpus

        return open_pair_corpus(spec)

    @staticmethod
    def model_config(config, corpus, data: str):
        """An encoder-decoder (Transformer or RNN) whose vocabularies are the corpus's."""
        from txl.models.registry import is_seq2seq

        if not is_seq2seq(config):
            raise ConfigError(f"{corpus.name} is a sequence-to-sequence corpus: it trains model.arch="
                              "'encoder-decoder' or 'rnn-seq2seq' (e.g. --preset seq2seq-reverse), not a "
                              "decoder-only LM")
        vocab = corpus.vocab
        return config.replace(source_vocab_size=0 if vocab.shared else vocab.source.size,
                              share_embeddings=config.share_embeddings and vocab.shared)

    def batches(self):
        from txl.data.seq2seq import PairBatches

        # batch_size pairs per step, bucketed by length
        return PairBatches(self.corpus.pairs("train"), self.corpus.vocab, batch_size=self.cfg.batch_size,
                           seed=self.cfg.seed)

    def check_batch(self, batch) -> None:
        pass  # pair ids are encoded in memory by this run's own vocabulary

    def tokens(self, batch, scored: int) -> int:
        return scored  # a pair batch: its scored target tokens over all ranks

    def step(self, forward: Callable, batch) -> tuple[float, int]:
        """Label smoothing in the loss that is minimised, the unsmoothed NLL in the records."""
        dist, device = self.dist, self.dist.device
        rows = dist.rows(batch.source.shape[0]) if batch.source.shape[0] >= dist.world else slice(None)
        tensors = [t[rows].to(device, non_blocking=True) for t in
                   (batch.source, batch.attention_mask, batch.decoder_input, batch.labels)]
        micro = max(tensors[0].shape[0] // self.cfg.grad_accum, 1)
        count = int((tensors[3] != -100).sum())
        nll_sum = torch.zeros((), dtype=torch.float64, device=device)
        chunks = list(zip(*(t.split(micro) for t in tensors)))
        for j, (src, mask, dec, labels) in enumerate(chunks):
            with self._sync(last=j == len(chunks) - 1):
                with autocast(device, self.precision):
                    out = forward(src, mask, dec, labels, label_smoothing=self.cfg.label_smoothing)
                depth = getattr(out, "ponder_depth", None)  # a universal encoder-decoder: the decoder's ACT depth
                self.ponder_depth = None if depth is None else depth.detach()
                # mean over the step's scored tokens, whatever their split into micro-batches
                scale = int((labels != -100).sum()) / max(count, 1)
                self.scaler.scale(out.loss * scale).backward()
            nll_sum += out.nll.detach().double().sum() + out.loss.detach().double() * 0
        return float(nll_sum), count

    def evaluate(self, model, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        """Teacher-forced NLL and token accuracy (decoding scores come at the end, `final_extras`)."""
        from txl.eval.seq2seq import teacher_forced

        return teacher_forced(model, self.corpus, split, batch_size=self.cfg.eval_batch_size,
                              device=self.dist.device, precision=self.precision)

    def final_extras(self, model, split: str) -> dict:
        """The split decoded greedily and with beam search (train.beam_size)."""
        from txl.eval.seq2seq import decode_split

        cfg = self.cfg
        # the final scores' cap (final_max_tokens, else eval_max_tokens; 0 = whole split) bounds the decoding
        # too: the first pairs whose target tokens fit in it (at least one)
        cap = cfg.eval_max_tokens if cfg.final_max_tokens is None else cfg.final_max_tokens
        max_pairs = 0
        if cap:
            total = 0
            for _, target in self.corpus.pairs(split):
                total += len(target)
                if total > cap and max_pairs:
                    break
                max_pairs += 1
        decoded = [decode_split(model, self.corpus, split, beam_size=beam, alpha=cfg.length_penalty,
                                batch_size=max(cfg.eval_batch_size, 32), device=self.dist.device,
                                max_pairs=max_pairs).to_dict()
                   for beam in sorted({1, cfg.beam_size})]
        return {"decoded": decoded}

    def next_commands(self, run: str) -> list[tuple[str, str]]:
        steps = super().next_commands(run)
        test = " --split test" if "test" in self.corpus.splits else ""
        steps[:2] = [(f"txl eval {run}{test}", "loss, token accuracy, exact match, ROUGE, sample outputs"),
                     (f"txl generate {run} --input FILE", "decode one source per line of FILE")]
        return steps


class Classification(LanguageModelling):
    """Long-document classification (issue 47): each document of a `docs:` collection read segment by segment,
    the memory carrying the earlier segments, and classified from its last segment
    (`txl.models.transformer_xl.classify`). A step is one batch of documents of equal segment count
    (`txl.data.documents.DocumentBatches`); its loss the mean cross-entropy per document. The memory lives
    inside a step (one document each row), so nothing is carried between steps or saved."""

    name = "classify"
    writes_sample = False

    @staticmethod
    def open_corpus(spec: str, *, vocab=None):
        from txl.data.documents import open_documents

        return open_documents(spec, vocab=vocab)

    @staticmethod
    def model_config(config, corpus, data: str):
        """The decoder with a head of the collection's classes."""
        if config.arch != "decoder":
            raise ConfigError(f"train.objective='classify' reads documents with the Transformer-XL decoder, not "
                              f"model.arch={config.arch!r}")
        if len(corpus.labels) < 2:
            raise DataError(f"{data}: classification needs labelled documents of at least 2 labels (one sub-folder "
                            f"per label, or a 'label' field in each JSONL record); found {len(corpus.labels)}")
        return config.replace(num_labels=len(corpus.labels))

    def __init__(self, cfg, corpus, dist, **kwargs):
        super().__init__(cfg, corpus, dist, **kwargs)
        if dist.world > 1:
            raise ConfigError("train.objective='classify' runs in one process for now (its step calls the model's "
                              "classify outside DDP); drop --nproc")
        self.model = getattr(self.ddp, "module", self.ddp)
        self.segments = self.model.config.classifier_segments

    def batches(self):
        from txl.data.documents import DocumentBatches

        ids, targets = self.corpus.documents("train")
        keep = [i for i, t in enumerate(targets) if t >= 0]
        cfg = self.cfg
        return DocumentBatches([ids[i] for i in keep], [targets[i] for i in keep], batch_size=cfg.batch_size,
                               tgt_len=cfg.tgt_len, seed=cfg.seed, max_len=cfg.tgt_len if self.segments == "first" else 0)

    def check_batch(self, batch) -> None:
        self.check_token_ids(int(batch.input_ids.max()), "train")

    def tokens(self, batch, scored: int) -> int:
        return int(batch.lengths.sum())  # the document tokens read

    def step(self, forward: Callable, batch) -> tuple[float, int]:
        """(summed cross-entropy over the batch's documents, their count); micro-batches by rows (grad_accum)."""
        device = self.dist.device
        rows = batch.input_ids.shape[0]
        nll_sum = torch.zeros((), dtype=torch.float64, device=device)
        for chunk in torch.arange(rows).tensor_split(min(self.cfg.grad_accum, rows)):
            with autocast(device, self.precision):
                out = self.model.classify(batch.input_ids[chunk].to(device), lengths=batch.lengths[chunk],
                                          labels=batch.labels[chunk].to(device), tgt_len=self.cfg.tgt_len,
                                          segments=self.segments)
            self.scaler.scale(out.loss * (len(chunk) / rows)).backward()
            nll_sum += out.loss.detach().double() * len(chunk)
        return float(nll_sum), rows

    def evaluate(self, model, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        """The split's mean cross-entropy per document, its accuracy beside it (`eval_max_tokens` is not a
        document count: every labelled document of the split is read)."""
        return self.scores(model, split).as_eval_result(self.corpus.metric)

    def scores(self, model, split: str):
        from txl.eval.classify import evaluate_classifier

        return evaluate_classifier(model, self.corpus, split, tgt_len=self.cfg.eval_tgt_len or self.cfg.tgt_len,
                                   batch_size=self.cfg.eval_batch_size, device=self.dist.device,
                                   precision=self.precision)

    def final_extras(self, model, split: str) -> dict:
        """Accuracy, macro-F1, per-class scores and the confusion matrix."""
        return {"classification": self.scores(model, split).to_dict()}

    def next_commands(self, run: str) -> list[tuple[str, str]]:
        test = " --split test" if "test" in self.corpus.splits else ""
        return [(f"txl eval {run}{test}", "accuracy, macro-F1 and the confusion matrix (--json for JSON)"),
                (f"txl plot {run}", "training curves as a PNG"),
                (f"txl train --resume {run} --max-steps N", "train longer")]


OBJECTIVES = {cls.name: cls for cls in (LanguageModelling, MaskedLanguageModelling, SequenceToSequence, Classification)}


def objective_class(cfg, spec: str) -> type[LanguageModelling]:
    """A pair corpus trains sequence-to-sequence; any other corpus the configured objective (lm, mlm or
    classify: a `docs:` collection with labels)."""
    from txl.data import parse_spec
    from txl.data.spec import SEQ2SEQ_CORPORA

    name = parse_spec(spec).name
    if cfg.objective == "classify" and name != "docs":
        raise ConfigError(f"train.objective='classify' reads labelled documents: write --data docs:DIR (one "
                          f"sub-folder per label) or docs:FILE.jsonl (text and label), not {spec!r}")
    if name == "style":  # two styles of unpaired sentences: the Style Transformer (txl.train.style)
        from txl.train.style import StyleTransfer

        return StyleTransfer
    return SequenceToSequence if name in SEQ2SEQ_CORPORA else OBJECTIVES[cfg.objective]
