"""Long-document classification (issue 47 item 3): the document reader (txl.data.documents), the classifier
reading a document segment by segment with the memory (txl.models.transformer_xl.classify), its objective,
`txl eval` on a classifier run, and `--init-from` a language-model run.

The memory's defining property is tested without training: on documents of three segments whose label
would sit in the *second* one, the logits (and the head's gradients) change with that segment's tokens when
the memory carries it; reading the first segment only, or the last without memory, they are invariant to it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
from pathlib import Path

import pytest
import torch

from txl.data.documents import (
    DocumentBatches,
    bucket_batches,
    open_documents,
    read_documents,
    segments_of,
    split_of,
)
from txl.data.spec import parse_spec
from txl.errors import DataError, UsageError
from txl.eval.classify import confusion_matrix, format_report, scores_from_confusion
from txl.models.registry import build_model
from txl.models.transformer_xl.classify import TransformerXLClassifier
from txl.models.transformer_xl.config import TransformerXLConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(vocab_size=12, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8, dropout=0.0,
              dropatt=0.0, num_labels=3)
T = 8  # tgt_len of the property tests: documents of 3 segments are 17..24 tokens


def classifier(**overrides) -> TransformerXLClassifier:
    torch.manual_seed(0)
    return build_model(TransformerXLConfig(**{**CONFIG, **overrides})).eval()


# ---------------------------------------------------------------------------------------------
# The reader


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def test_label_folders_are_labelled_documents_hidden_and_empty_skipped(tmp_path):
    write(tmp_path / "spam" / "a.txt", "buy now")
    write(tmp_path / "spam" / "b.txt", "cheap pills")
    write(tmp_path / "ham" / "c.txt", "meeting at noon")
    write(tmp_path / "ham" / "empty.txt", "  \n")
    write(tmp_path / "ham" / ".hidden", "not read")
    docs = read_documents(tmp_path)
    assert docs.labels == ("ham", "spam") and docs.labelled and docs.skipped == 1
    every = sorted((d.label, d.text) for split in docs.splits.values() for d in split)
    assert every == [("ham", "meeting at noon"), ("spam", "buy now"), ("spam", "cheap pills")]
    for split, split_docs in docs.splits.items():  # the 90/5/5 hash split, stable
        assert all(split_of(d.text) == split for d in split_docs)


def test_flat_folder_is_unlabelled_and_given_splits_are_kept(tmp_path):
    write(tmp_path / "flat" / "1.txt", "one")
    write(tmp_path / "flat" / "2.txt", "two")
    flat = read_documents(tmp_path / "flat")
    assert flat.labels == () and not flat.labelled and sum(map(len, flat.splits.values())) == 2
    write(tmp_path / "given" / "train" / "x" / "1.txt", "alpha")
    write(tmp_path / "given" / "train" / "y" / "2.txt", "beta")
    write(tmp_path / "given" / "test" / "x" / "3.txt", "gamma")
    given = read_documents(tmp_path / "given")
    assert [d.text for d in given.splits["train"]] == ["alpha", "beta"]
    assert [d.text for d in given.splits["test"]] == ["gamma"] and given.splits["valid"] == []


def test_jsonl_text_and_label(tmp_path):
    rows = [{"text": "first", "label": "a"}, {"text": "second", "label": 7}, {"text": "", "label": "a"}]
    path = write(tmp_path / "docs.jsonl", "\n".join(map(json.dumps, rows)) + "\n\n")
    docs = read_documents(path)
    assert docs.labels == ("7", "a") and docs.skipped == 1
    assert {d.source for split in docs.splits.values() for d in split} == {f"{path}:1", f"{path}:2"}
    write(tmp_path / "dir" / "train.jsonl", json.dumps({"text": "x", "label": "a"}))
    write(tmp_path / "dir" / "valid.jsonl", json.dumps({"text": "y", "label": "b"}))
    assert [len(v) for v in read_documents(tmp_path / "dir").splits.values()] == [1, 1, 0]


def bad_case(tmp_path: Path, case: str) -> Path:
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "link-inside":
        write(tmp_path / "elsewhere.txt", "secret")
        (tmp_path / "c" / "a").mkdir(parents=True)
        os.symlink(tmp_path / "elsewhere.txt", tmp_path / "c" / "a" / "x.txt")
    elif case == "files-and-folders":
        write(tmp_path / "c" / "a" / "x.txt", "text")
        write(tmp_path / "c" / "loose.txt", "text")
    elif case == "nested-folder":
        write(tmp_path / "c" / "a" / "deeper" / "x.txt", "text")
    elif case == "bad-utf8":
        write(tmp_path / "c" / "a" / "x.txt", b"ok \xff\xfe not utf-8")
    elif case == "not-jsonl":
        return write(tmp_path / "c.txt", "a plain file")
    elif case == "jsonl-not-object":
        return write(tmp_path / "c.jsonl", '{"text": "a", "label": "x"}\n[1, 2]\n')
    elif case == "jsonl-no-text":
        return write(tmp_path / "c.jsonl", '{"body": "a"}\n')
    elif case == "jsonl-bool-label":
        return write(tmp_path / "c.jsonl", '{"text": "a", "label": true}\n')
    elif case == "jsonl-broken":
        return write(tmp_path / "c.jsonl", '{"text": "a"\n')
    elif case == "mixed-labels":
        return write(tmp_path / "c.jsonl", '{"text": "a", "label": "x"}\n{"text": "b"}\n')
    elif case == "only-empty":
        write(tmp_path / "c" / "a" / "x.txt", "   ")
    elif case == "valid-without-train":
        write(tmp_path / "c" / "valid" / "a" / "x.txt", "text")
    elif case == "fifo":
        (tmp_path / "c" / "a").mkdir(parents=True)
        os.mkfifo(tmp_path / "c" / "a" / "pipe")
    return tmp_path / "c"


BAD = ["missing", "link-inside", "files-and-folders", "nested-folder", "bad-utf8", "not-jsonl", "jsonl-not-object",
       "jsonl-no-text", "jsonl-bool-label", "jsonl-broken", "mixed-labels", "only-empty", "valid-without-train", "fifo"]


@pytest.mark.parametrize("case", BAD)
def test_bad_collections_are_one_line(tmp_path, case):
    with pytest.raises(DataError) as err:
        read_documents(bad_case(tmp_path, case))
    assert "\n" not in str(err.value) and str(err.value)


def test_a_document_over_the_limit_is_one_line(tmp_path, monkeypatch):
    import txl.data.documents as documents

    monkeypatch.setattr(documents, "DOCUMENT_LIMIT", 10)
    write(tmp_path / "a" / "x.txt", "more than ten bytes")
    with pytest.raises(DataError, match="more than the 10 bytes"):
        read_documents(tmp_path)


def test_docs_spec_options_and_encoding(tmp_path):
    write(tmp_path / "a" / "x.txt", "ab ab ab cd")
    write(tmp_path / "b" / "y.txt", "cd ef")
    spec = parse_spec(f"docs:{tmp_path}?tokenizer=words&max_tokens=3")
    assert spec.options["tokenizer"] == "words" and spec.options["max_tokens"] == 3
    corpus = open_documents(spec)
    assert corpus.vocab.kind == "words" and corpus.labels == ("a", "b") and corpus.truncated == 1
    ids, targets = corpus.documents("train") if "train" in corpus.splits else ([], [])
    assert all(len(x) <= 3 for x in ids) and set(targets) <= {0, 1}
    with pytest.raises(DataError, match="not one of bytes, chars, words"):
        parse_spec(f"docs:{tmp_path}?tokenizer=bpe")


# ---------------------------------------------------------------------------------------------
# Batching: equal segment counts, each row as it is alone


def test_buckets_hold_equal_segment_counts_and_every_document_once():
    lengths = [3, 8, 9, 16, 17, 40, 1, 24, 25]
    batches = bucket_batches(lengths, tgt_len=T, batch_size=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len({segments_of(lengths[i], T) for i in b}) == 1 and len(b) <= 2


def test_document_batches_resume_where_they_stopped():
    import numpy as np

    ids = [np.arange(n) % 7 for n in (5, 9, 12, 20, 30, 3, 17)]
    first = DocumentBatches(ids, list(range(7)), batch_size=2, tgt_len=T, seed=3)
    stream = iter(first)
    seen = [next(stream).labels.tolist() for _ in range(4)]
    state = first.state_dict()
    rest = [next(stream).labels.tolist() for _ in range(6)]
    again = DocumentBatches(ids, list(range(7)), batch_size=2, tgt_len=T, seed=3)
    again.load_state_dict(state)
    assert [b.labels.tolist() for b, _ in zip(again, range(6))] == rest
    assert sorted(x for b in seen + rest[:1] for x in b)  # epochs cover every document
    with pytest.raises(DataError):
        again.load_state_dict({"kind": "documents", "epoch": 0, "position": 0, "seed": 4})


def test_a_padded_batch_classifies_each_document_as_alone():
    """Only the last segment is padded, so causal attention keeps each row exact (1e-5)."""
    for pooling in ("mean", "last", "summary"):
        model = classifier(classifier_pooling=pooling)
        x = torch.randint(0, 12, (3, 24))
        lengths = torch.tensor([24, 17, 20])
        together = model.classify(x, lengths=lengths, tgt_len=T).logits
        for i in range(3):
            alone = model.classify(x[i : i + 1, : lengths[i]], tgt_len=T).logits
            torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-5)
    with pytest.raises(UsageError, match="same number of segments"):
        model.classify(x, lengths=torch.tensor([24, 8, 20]), tgt_len=T)


# ---------------------------------------------------------------------------------------------
# The memory's defining property: the second segment decides, the first and the last do not hold it


def second_segment_variants() -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches of 3-segment documents equal everywhere but in the second segment."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 12, (2, 3 * T), generator=gen)
    b = a.clone()
    b[:, T : 2 * T] = torch.randint(0, 12, (2, T), generator=gen)
    assert not torch.equal(a[:, T : 2 * T], b[:, T : 2 * T])
    return a, b


@pytest.mark.parametrize("pooling", ["mean", "last", "summary"])
def test_with_memory_the_logits_depend_on_an_earlier_segment(pooling):
    a, b = second_segment_variants()
    model = classifier(classifier_pooling=pooling)
    with_memory = [model.classify(x, tgt_len=T).logits for x in (a, b)]
    assert (with_memory[0] - with_memory[1]).abs().max() > 1e-4
    first_only = [model.classify(x, tgt_len=T, segments="first").logits for x in (a, b)]
    torch.testing.assert_close(first_only[0], first_only[1], rtol=0, atol=0)
    no_memory = [model.classify(x, tgt_len=T, mem_len=0).logits for x in (a, b)]  # the last segment alone
    torch.testing.assert_close(no_memory[0], no_memory[1], rtol=0, atol=0)
    # first-only reads exactly the first segment: the same logits as the truncated documents
    torch.testing.assert_close(first_only[0], model.classify(a[:, :T], tgt_len=T).logits, rtol=0, atol=1e-6)


def test_the_objective_gradients_see_an_earlier_segment_only_with_memory():
    """The classification objective's step: the head's gradient differs between the two batches with memory,
    and is identical when the model reads only the first segment (config classifier_segments=first)."""
    from types import SimpleNamespace

    from txl.data.documents import DocumentBatch
    from txl.train.objectives import Classification

    def head_gradient(segments: str, x: torch.Tensor) -> torch.Tensor:
        model = classifier(classifier_segments=segments).train()
        cfg = SimpleNamespace(grad_accum=1, tgt_len=T, batch_size=2, seed=0, eval_batch_size=2, eval_tgt_len=0)
        dist = SimpleNamespace(world=1, device=torch.device("cpu"), rows=lambda n: slice(None))
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        objective = Classification(cfg, None, dist, vocab_size=12, precision="fp32", scaler=scaler, ddp=model)
        batch = DocumentBatch(x, torch.tensor([3 * T, 3 * T]), torch.tensor([0, 2]))
        total, count = objective.step(model, batch)
        assert count == 2 and total > 0
        return model.classifier.weight.grad.clone()

    a, b = second_segment_variants()
    assert (head_gradient("all", a) - head_gradient("all", b)).abs().max() > 1e-6
    torch.testing.assert_close(head_gradient("first", a), head_gradient("first", b), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Scores


def test_accuracy_macro_f1_and_confusion():
    truth = [0, 0, 1, 1, 2, 2]
    predicted = [0, 1, 1, 1, 0, 2]
    confusion = confusion_matrix(truth, predicted, 3)
    assert confusion == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    accuracy, macro_f1, per_class = scores_from_confusion(confusion, ["a", "b", "c"])
    assert accuracy == pytest.approx(4 / 6)
    f1 = [0.5, 0.8, 2 / 3]  # a: p 1/2 r 1/2; b: p 2/3 r 1; c: p 1 r 1/2
    assert [per_class[k]["f1"] for k in "abc"] == pytest.approx(f1)
    assert macro_f1 == pytest.approx(sum(f1) / 3)


# ---------------------------------------------------------------------------------------------
# The command line: a tiny generated collection, train 3 steps, evaluate, fine-tune from an LM run


def cli(*argv: str) -> tuple[int, str, str]:
    from txl.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def generated_collection(root: Path) -> Path:
    """Two labels told apart by a word in the middle of a longer document, with given splits."""
    rng = random.Random(0)
    words = ["memory", "segment", "layer", "token", "head"]
    for split, count in (("train", 12), ("valid", 4), ("test", 4)):
        for label, marker in (("left", "west"), ("right", "east")):
            for i in range(count):
                body = [rng.choice(words) for _ in range(rng.randint(12, 30))]
                body.insert(len(body) // 2, marker)
                write(root / split / label / f"{i}.txt", " ".join(body))
    return root


TINY_SETS = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.d_head=8", "--set",
             "model.d_inner=32", "--set", "model.mem_len=16", "--set", "tgt_len=16", "--set", "batch_size=4",
             "--set", "eval_batch_size=8", "--set", "eval_interval=3", "--quiet", "--threads", "1"]


def test_cli_journey_train_then_eval(tmp_path):
    data = f"docs:{generated_collection(tmp_path / 'docs')}"
    code, _, err = cli("train", "--objective", "classify", "--data", data, "--max-steps", "3", "--out",
                       str(tmp_path / "run"), *TINY_SETS)
    assert code == 0, err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert "classification" in json.dumps(result)
    code, out, err = cli("eval", str(tmp_path / "run"), "--split", "test")
    assert code == 0, err
    assert "accuracy" in out and "macro-F1" in out and "confusion (rows: true, columns: predicted)" in out
    code, out, err = cli("eval", str(tmp_path / "run"), "--split", "test", "--json")
    scores = json.loads(out)
    assert scores["documents"] == 8 and scores["labels"] == ["left", "right"]
    assert sum(map(sum, scores["confusion"])) == 8 and 0 <= scores["macro_f1"] <= 1
    code, _, err = cli("eval", str(tmp_path / "run"), "--vanilla")
    assert code != 0 and "document classifier" in err and "Traceback" not in err
    # the first-segment baseline is one setting, recorded in the model config
    code, _, err = cli("train", "--objective", "classify", "--data", data, "--max-steps", "1", "--out",
                       str(tmp_path / "first"), "--set", "classifier_segments=first", *TINY_SETS)
    assert code == 0, err
    assert json.loads((tmp_path / "first" / "run.json").read_text())["model"]["classifier_segments"] == "first"


def test_classify_needs_a_docs_collection_with_labels(tmp_path):
    write(tmp_path / "t.txt", "some text " * 50)
    code, _, err = cli("train", "--objective", "classify", "--data", f"text:{tmp_path / 't.txt'}", "--max-steps", "1",
                       "--out", str(tmp_path / "r"), *TINY_SETS)
    assert code != 0 and "docs:DIR" in err and "Traceback" not in err
    write(tmp_path / "flat" / "1.txt", "one document")
    code, _, err = cli("train", "--objective", "classify", "--data", f"docs:{tmp_path / 'flat'}", "--max-steps", "1",
                       "--out", str(tmp_path / "r2"), *TINY_SETS)
    assert code != 0 and "at least 2 labels" in err and "Traceback" not in err


def test_init_from_a_language_model_run(tmp_path):
    """The LM's weights are copied (every one of them), the head starts fresh."""
    lm_text = write(tmp_path / "lm" / "train.txt", " ".join(random.Random(1).choice(["memory", "west", "east",
                                                                                     "layer"]) for _ in range(3000)))
    code, _, err = cli("train", "--data", f"text:{lm_text.parent}", "--max-steps", "2", "--out", str(tmp_path / "lm_run"),
                       "--set", "sample_tokens=0", *TINY_SETS)
    assert code == 0, err
    data = f"docs:{generated_collection(tmp_path / 'docs')}"
    code, _, err = cli("train", "--objective", "classify", "--data", data, "--init-from", str(tmp_path / "lm_run"),
                       "--max-steps", "1", "--out", str(tmp_path / "ft"), "--set", "lr=1e-30", *TINY_SETS)
    assert code == 0, err
    from safetensors.torch import load_file

    lm = load_file(tmp_path / "lm_run" / "last" / "model.safetensors")
    ft = load_file(tmp_path / "ft" / "last" / "model.safetensors")
    assert set(ft) - set(lm) == {"classifier.weight", "classifier.bias"}
    for name, tensor in lm.items():  # lr=1e-30: one step leaves the copied weights as they were
        torch.testing.assert_close(ft[name], tensor, rtol=0, atol=1e-20)
    assert json.loads((tmp_path / "ft" / "run.json").read_text())["init_from"]


def test_the_summary_token_is_learned_and_only_in_summary_models():
    """pooling='summary': a d_model parameter (its gradient flows), placed right after each row's real tokens;
    the other poolings have no such parameter (their state dicts are unchanged)."""
    model = classifier(classifier_pooling="summary").train()
    x = torch.randint(0, 12, (2, 20))
    out = model.classify(x, lengths=torch.tensor([20, 18]), labels=torch.tensor([1, 0]), tgt_len=T)
    out.loss.backward()
    assert model.summary.grad is not None and model.summary.grad.abs().sum() > 0
    assert "summary" not in classifier(classifier_pooling="mean").state_dict()
    with pytest.raises(UsageError, match="summary"):
        classifier().classify(x, tgt_len=T, pooling="summary")


def test_report_table_names_every_label():
    from txl.eval.classify import ClassificationScores

    confusion = [[3, 1], [0, 4]]
    accuracy, macro_f1, per_class = scores_from_confusion(confusion, ["sys", "lib"])
    text = format_report(ClassificationScores(split="test", labels=["sys", "lib"], documents=8, accuracy=accuracy,
                                              macro_f1=macro_f1, loss=0.5, per_class=per_class, confusion=confusion))
    assert "accuracy 0.8750" in text and text.splitlines()[-2].split() == ["sys", "3", "1"]


def test_a_resumed_classifier_run_continues_exactly(tmp_path):
    """The document iterator's position and the RNG come back: 2 + 2 steps = 4 steps, bit for bit."""
    data = f"docs:{generated_collection(tmp_path / 'docs')}"
    # one thread for all three: txl's default follows the machine's load, and bit-exactness needs equal threads
    sets = [*TINY_SETS, "--set", "eval_interval=2", "--set", "model.dropout=0.1", "--threads", "1"]
    code, _, err = cli("train", "--objective", "classify", "--data", data, "--max-steps", "4", "--out",
                       str(tmp_path / "straight"), *sets)
    assert code == 0, err
    code, _, err = cli("train", "--objective", "classify", "--data", data, "--max-steps", "2", "--out",
                       str(tmp_path / "resumed"), *sets)
    assert code == 0, err
    code, _, err = cli("train", "--resume", str(tmp_path / "resumed"), "--max-steps", "4", "--quiet", "--threads", "1")
    assert code == 0, err
    from safetensors.torch import load_file

    straight = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "last" / "model.safetensors")
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0)
