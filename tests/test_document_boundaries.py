"""Document boundaries inside the memory (issue 47 item 2): a corpus read as documents that never see each
other. The iterator (`ShuffledSentenceIterator(boundaries=True)`) starts every document at column 0 of a
row, pads the rest of the segment where it ends and asks for the row's memory to be reset before the next
one; the model (`attention_mask` with memory, `Memory.reset`) then gives each document the logits it gets
alone. Evaluation (`evaluate(documents=...)`) and the LM objective's training step
(`train.document_boundaries = true`) use it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from txl import TransformerXLConfig
from txl.data.iterators import ShuffledSentenceIterator, document_offsets, separator_offsets
from txl.errors import ConfigError
from txl.eval.segments import evaluate
from txl.models.transformer_xl.model import TransformerXL
from txl.train.objectives import LanguageModelling

SEP, VOCAB, T = 1, 40, 6


def model_for(backend: str = "auto", **overrides) -> TransformerXL:
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=T,
                dropout=0.0, dropatt=0.0, backend=backend)
    return TransformerXL(TransformerXLConfig(**{**base, **overrides})).eval()


def corpus_tokens(lengths=(9, 3, 14, 7, 2, 11), seed: int = 0) -> np.ndarray:
    """Documents of these lengths (each ending with the separator) laid end to end."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, VOCAB, n - 1), SEP) for n in lengths]
    return np.concatenate(docs).astype(np.int64)


def run_batches(model, iterator):
    """Every batch with the reset and the padding; returns {target position: logits row}."""
    memory, out = None, {}
    with torch.no_grad():
        for batch in iterator.epoch():
            if memory is not None:
                memory = memory.reset(batch.reset)
            result = model(batch.inputs, memory=memory, attention_mask=batch.attention_mask)
            memory = result.memory
            for b, t in zip(*torch.nonzero(batch.score_mask, as_tuple=True), strict=True):
                out[int(batch.positions[b, t])] = result.logits[b, t]
    return out


def alone(model, tokens, offsets):
    """{target position: logits row} of each document run alone, segment by segment from its first token."""
    out = {}
    with torch.no_grad():
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            doc, memory = torch.as_tensor(tokens[start:end - 1])[None], None  # its n - 1 inputs
            for s in range(0, doc.shape[1], T):
                result = model(doc[:, s : s + T], memory=memory)
                memory = result.memory
                for t in range(result.logits.shape[1]):
                    out[int(start) + s + t + 1] = result.logits[0, t]
    return out


def test_separator_offsets_and_lengths():
    tokens = np.array([5, 6, SEP, 7, SEP, 8, 9])
    assert separator_offsets(tokens, SEP).tolist() == [0, 3, 5, 7]
    assert separator_offsets(tokens[:5], SEP).tolist() == [0, 3, 5]
    assert document_offsets([3, 2, 2]).tolist() == [0, 3, 5, 7]


def test_boundary_batches_start_each_document_at_column_zero_and_reset_the_row():
    tokens = corpus_tokens()
    offsets = separator_offsets(tokens, SEP)
    iterator = ShuffledSentenceIterator(tokens, offsets, 2, T, shuffle=False, drop_last=False, boundaries=True)
    seen = []
    for batch in iterator.epoch():
        assert batch.attention_mask is not None and batch.reset.dtype == torch.bool
        real = batch.attention_mask.bool()
        assert torch.equal(real, batch.score_mask)
        for b in range(2):
            row = real[b]
            # one run of real tokens from column 0 (right padding only)
            assert not row.any() or (row[0] and torch.equal(row, row.cummin(0).values))
            if batch.reset[b] and row.any():
                first = int(batch.positions[b, 0]) - 1  # the input of the first target
                assert first in offsets[:-1].tolist()  # a document's first token
        seen += batch.positions[batch.score_mask].tolist()
    # every (input, target) pair of every document, once; no pair crosses a document boundary
    expected = [p for s, e in zip(offsets[:-1], offsets[1:], strict=True) for p in range(s + 1, e)]
    assert sorted(seen) == expected


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_documents_do_not_see_each_other(backend):
    """Each document's logits in the batched row streams equal the document run alone, and changing one
    document's tokens leaves every other document's logits unchanged (a row carries several documents)."""
    model = model_for(backend)
    tokens = corpus_tokens()
    offsets = separator_offsets(tokens, SEP)

    def iterator(toks):
        return ShuffledSentenceIterator(toks, offsets, 2, T, shuffle=False, drop_last=False, boundaries=True)

    batched = run_batches(model, iterator(tokens))
    reference = alone(model, tokens, offsets)
    assert batched.keys() == reference.keys()
    for position, logits in batched.items():
        torch.testing.assert_close(logits, reference[position], atol=1e-5, rtol=0)
    changed = tokens.copy()
    a_start, a_end = int(offsets[2]), int(offsets[3])  # document A, the third (14 tokens)
    changed[a_start : a_end - 1] = (changed[a_start : a_end - 1] + 7) % (VOCAB - 2) + 2
    after = run_batches(model, iterator(changed))
    differs = []
    for position, logits in batched.items():
        if a_start < position < a_end:
            differs.append(not torch.allclose(after[position], logits, atol=1e-6, rtol=0))
        else:
            torch.testing.assert_close(after[position], logits, atol=1e-6, rtol=0)
    assert any(differs)  # (document A itself did change)
    # without boundaries the stream layout lets a later document in A's row see A
    stream = ShuffledSentenceIterator(tokens, offsets, 2, T, shuffle=False, drop_last=False)
    assert stream.boundaries is False and next(iter(stream.epoch())).reset is None


def test_evaluation_scores_documents_independently():
    model = model_for()
    tokens = corpus_tokens()
    offsets = separator_offsets(tokens, SEP)
    result = evaluate(model, tokens, metric="ppl", batch_size=2, tgt_len=T, mem_len=T, documents=offsets)
    total, count = 0.0, 0
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        alone = evaluate(model, tokens[start:end], metric="ppl", batch_size=1, tgt_len=T, mem_len=T,
                         warm_memory=False)
        total += alone.loss * alone.tokens
        count += alone.tokens
    assert result.tokens == count == len(tokens) - (len(offsets) - 1)
    assert result.loss == pytest.approx(total / count, abs=1e-6)
    # the row-grouped path of long evaluations takes the padding and resets too
    import txl.eval.segments as segments

    saved = segments.EVAL_GROUP_ELEMENTS
    try:
        segments.EVAL_GROUP_ELEMENTS = 1  # one row per group
        grouped = evaluate(model, tokens, metric="ppl", batch_size=3, tgt_len=T, mem_len=T, documents=offsets)
    finally:
        segments.EVAL_GROUP_ELEMENTS = saved
    assert grouped.loss == pytest.approx(total / count, abs=1e-6)


class _Dist:
    device, world = torch.device("cpu"), 1

    @staticmethod
    def rows(n):
        return slice(0, n)


class _Scaler:
    @staticmethod
    def scale(loss):
        return loss


class _Corpus:
    def __init__(self, tokens, offsets):
        self.tokens, self.offsets, self.name, self.metric = tokens, offsets, "docs", "ppl"

    def split(self, split):
        return self.tokens

    def sentence_offsets(self, split):
        return self.offsets


def objective(corpus, *, boundaries: bool):
    cfg = SimpleNamespace(batch_size=2, tgt_len=T, grad_accum=1, varlen=False, roll=False, seed=0,
                          document_boundaries=boundaries, data="docs")
    return LanguageModelling(cfg, corpus, _Dist(), vocab_size=VOCAB, precision="fp32", scaler=_Scaler(), ddp=None)


def test_training_with_document_boundaries_reads_each_document_alone():
    """The LM objective's step over an epoch of document batches: the summed NLL and the count are each
    document's own (run alone), so no document's loss depends on another."""
    model = model_for()
    tokens = corpus_tokens(seed=3)
    offsets = separator_offsets(tokens, SEP)
    lm = objective(_Corpus(tokens, offsets), boundaries=True)
    batches = lm.batches()
    assert isinstance(batches, ShuffledSentenceIterator) and batches.boundaries and batches.shuffle
    total, count = 0.0, 0
    for batch in batches.epoch():
        lm.check_batch(batch)
        nll, scored = lm.step(model, batch)
        total, count = total + nll, count + scored
    model.zero_grad()
    expected = 0.0
    with torch.no_grad():
        reference = alone(model, tokens, offsets)
        for position, logits in reference.items():
            expected -= float(torch.log_softmax(logits, -1)[int(tokens[position])])
    # drop_last (training) leaves out the epoch's final, partial batch: compare over what was read
    assert 0 < count <= len(reference)
    if count == len(reference):
        assert total == pytest.approx(expected, rel=1e-5)
    else:
        assert total < expected


def test_training_documents_equal_alone_exactly_when_every_batch_is_kept():
    model = model_for()
    tokens = corpus_tokens(lengths=(7, 7, 7, 7), seed=4)  # 6 pairs each = one segment: no partial batch
    offsets = separator_offsets(tokens, SEP)
    lm = objective(_Corpus(tokens, offsets), boundaries=True)
    total, count = 0.0, 0
    for batch in lm.batches().epoch():
        nll, scored = lm.step(model, batch)
        total, count = total + nll, count + scored
    reference = alone(model, tokens, offsets)
    expected = -sum(float(torch.log_softmax(logits, -1)[int(tokens[p])]) for p, logits in reference.items())
    assert count == len(reference) == 24
    assert total == pytest.approx(expected, rel=1e-5)


def test_document_boundaries_need_a_corpus_that_records_documents():
    class Stream:
        name, metric = "stream", "ppl"

        def split(self, split):
            return corpus_tokens()

        def sentence_offsets(self, split):
            return None

    with pytest.raises(ConfigError, match="train.document_boundaries=true needs a corpus"):
        objective(Stream(), boundaries=True).batches()
    assert objective(Stream(), boundaries=False).documents("train") is None


def _collection(tmp_path, count: int = 60):
    import json
    import random

    rng = random.Random(0)
    words = ["memory", "segment", "attention", "relative", "token", "the", "of", "and"]
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))}) for _ in range(count)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_jsonl_collection_is_a_document_stream_for_language_modelling(tmp_path):
    """`docs:FILE.jsonl` through txl.data.documents (the one reader of collections): each split's documents
    end to end, their starts recorded, and the boundary batches start every document fresh."""
    from txl.data.document_stream import DocumentStream

    corpus = LanguageModelling.open_corpus(f"docs:{_collection(tmp_path)}")
    assert isinstance(corpus, DocumentStream) and "train" in corpus.splits
    ids, _ = corpus.documents_corpus.documents("train")
    offsets = corpus.sentence_offsets("train")
    assert offsets[-1] == len(corpus.split("train")) and len(offsets) == len(ids) + 1
    for k in (0, len(ids) - 1):
        assert np.array_equal(corpus.split("train")[offsets[k] : offsets[k + 1]], ids[k])
    lm = objective(corpus, boundaries=True)
    starts = set(offsets[:-1].tolist())
    for batch in lm.batches().epoch():
        for b in torch.nonzero(batch.reset).flatten().tolist():
            if batch.score_mask[b].any():
                assert int(batch.positions[b, 0]) - 1 in starts


def test_trainer_runs_lm_steps_with_document_boundaries(tmp_path):
    from helpers import train_losses, write_config
    from txl.train import Trainer
    from txl.train.config import build_run_config

    collection = _collection(tmp_path)
    config = write_config(tmp_path, collection, steps=3, dropout=0.0, varlen="false")
    config.write_text(config.read_text().replace(f"text:{collection}", f"docs:{collection}"))
    run = build_run_config(config_file=config, sets=["train.document_boundaries=true", "save_interval=3"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    trainer.fit()
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(v) for v in losses.values())
    result = trainer.objective.evaluate(trainer.model, "valid")  # documents scored independently
    per_document = sum(len(d) - 1 for d in trainer.objective.corpus.documents_corpus.documents("valid")[0])
    assert result.tokens == per_document
    trainer.close()
    # txl eval's computation: documents on their own by default for a run trained with boundaries, as one
    # stream when asked; asking for documents on text without document starts is one line
    from txl.errors import UsageError
    from txl.eval.api import evaluate_checkpoint

    by_default, _ = evaluate_checkpoint(tmp_path / "run", split="valid")
    as_stream, _ = evaluate_checkpoint(tmp_path / "run", split="valid", documents=False)
    assert by_default.tokens == per_document and by_default.loss == pytest.approx(result.loss, rel=1e-6)
    assert as_stream.tokens == len(trainer.objective.corpus.split("valid")) - 1
    plain = tmp_path / "plain.txt"
    plain.write_text("memory and attention " * 40)
    with pytest.raises(UsageError, match="records no document starts"):
        evaluate_checkpoint(tmp_path / "run", text=plain, documents=True)


def test_evaluation_of_documents_takes_a_cut_of_the_tokens():
    model = model_for()
    tokens = corpus_tokens()
    offsets = separator_offsets(tokens, SEP)
    cut = evaluate(model, tokens, metric="ppl", batch_size=2, tgt_len=T, mem_len=T, documents=offsets, max_tokens=20)
    whole = evaluate(model, tokens[:21], metric="ppl", batch_size=2, tgt_len=T, mem_len=T, documents=offsets)
    assert cut.tokens == whole.tokens == 21 - int((offsets < 21).sum())
    assert cut.loss == pytest.approx(whole.loss, abs=1e-7)


def test_txl_eval_reads_a_document_collection_for_a_language_model(tmp_path):
    """open_eval_corpus (txl eval's reader) opens a docs: collection for an LM checkpoint as a DocumentStream
    with the checkpoint's vocabulary."""
    from txl.data.document_stream import DocumentStream
    from txl.eval.corpus import open_eval_corpus

    collection = _collection(tmp_path)
    stream = LanguageModelling.open_corpus(f"docs:{collection}")
    ckpt = SimpleNamespace(vocab=stream.vocab, run={}, data_spec=None, path=tmp_path,
                           model=SimpleNamespace(config=SimpleNamespace(vocab_size=stream.vocab.size)))
    corpus, tokens = open_eval_corpus(ckpt, f"docs:{collection}", "train")
    assert isinstance(corpus, DocumentStream) and np.array_equal(tokens, stream.split("train"))
