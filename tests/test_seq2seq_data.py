"""Pair corpora, vocabularies and batches (txl.data.seq2seq), and the sequence-to-sequence journey
through the trainer and the CLI: train, resume exactly, eval, generate --input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from txl.cli.main import main
from txl.data.pydoc import split_identifier
from txl.data.seq2seq import PairBatches, PairVocab, collate, open_pair_corpus, read_pairs
from txl.errors import DataError
from txl.eval.seq2seq_metrics import exact_match

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    path = tmp_path_factory.getbasetemp() / "txl-cache"
    monkeypatch.setenv("TXL_CACHE_DIR", str(path))
    return path


def test_read_pairs_tsv_jsonl_and_the_inshorts_csv(tmp_path):
    (tmp_path / "a.tsv").write_text("source\ttarget\nhello world\thi\nlong text\tshort\n")
    (tmp_path / "b.jsonl").write_text('{"source": "x y", "target": "z"}\n\n{"source": "p", "target": "q"}\n')
    (tmp_path / "news.csv").write_text('headlines,text\n"4 ex-bank officials booked","The CBI on Saturday, booked four"\n')
    assert read_pairs(tmp_path / "a.tsv") == [("hello world", "hi"), ("long text", "short")]
    assert read_pairs(tmp_path / "b.jsonl") == [("x y", "z"), ("p", "q")]
    assert read_pairs(tmp_path / "news.csv") == [("The CBI on Saturday, booked four", "4 ex-bank officials booked")]


@pytest.mark.parametrize("name, text, match", [
    ("bad.jsonl", '{"source": "a"}\n', r"bad.jsonl:1 needs string fields 'source' and 'target'"),
    ("bad.jsonl", "[1, 2]\n", r"bad.jsonl:1 is not a JSON object"),
    ("bad.tsv", "a\tb\nonly one column\n", r"row 2 has 1 column"),
    ("bad.txt", "a\tb\n", r"\.tsv, \.jsonl or \.csv"),
    ("bad.csv", "title,body\nx,y\n", None),
])
def test_bad_pair_files_name_the_line(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    if match is None:  # unknown columns: the first two, in order
        assert read_pairs(tmp_path / name) == [("x", "y")]
        with pytest.raises(DataError, match="has no column 'summary'"):
            read_pairs(tmp_path / name, target="summary")
        return
    with pytest.raises(DataError, match=match):
        read_pairs(tmp_path / name)


def test_pairs_file_split_is_stable_and_the_vocabulary_round_trips(tmp_path):
    rows = [(f"source number {i}", f"target {i}") for i in range(400)]
    path = tmp_path / "p.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in rows))
    corpus = open_pair_corpus(f"pairs:{path}?tokenizer=chars")
    assert set(corpus.splits) == {"train", "valid", "test"}
    assert sum(len(corpus.pairs(s)) for s in corpus.splits) == 400
    assert 320 < len(corpus.pairs("train")) < 390
    path.write_text("".join(f"{s}\t{t}\n" for s, t in rows + [("one more", "pair")]))
    grown = open_pair_corpus(f"pairs:{path}?tokenizer=chars")
    assert set(corpus.references("test")) <= set(grown.references("test"))  # a pair keeps its split
    vocab = corpus.vocab
    vocab.save(tmp_path / "vocab.json")
    loaded = PairVocab.load(tmp_path / "vocab.json")
    assert loaded.fingerprint == vocab.fingerprint and loaded.shared
    assert loaded.target.decode(loaded.target.encode("target 7") + [loaded.target.eos_id, 3]) == "target 7"


def test_separate_vocabularies_and_length_filter(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"source": "abc" * (1 + i % 5), "target": "XYZ"[: 1 + i % 3]}) + "\n"
                            for i in range(200)))
    corpus = open_pair_corpus(f"pairs:{path}?tokenizer=chars&shared=0&max_source_len=9")
    vocab = corpus.vocab
    assert not vocab.shared and vocab.source.size == 3 + 3 and vocab.target.size == 3 + 3
    assert all(len(s) <= 9 for s, _ in corpus.pairs("train"))
    assert sum(corpus.dropped.values()) > 0
    with pytest.raises(DataError, match="raise the limits"):
        open_pair_corpus(f"pairs:{path}?tokenizer=chars&max_source_len=1")
    cut = open_pair_corpus(f"pairs:{path}?tokenizer=chars&shared=0&max_source_len=4&truncate=1")
    assert sum(cut.dropped.values()) == 0 and max(len(s) for s, _ in cut.pairs("train")) == 4


def test_collate_pads_on_the_right_with_teacher_forcing():
    corpus = open_pair_corpus("reverse?size=50")
    v = corpus.vocab.target
    batch = collate([([1, 2, 3], [4]), ([5], [6, 7])], corpus.vocab)
    assert batch.source.tolist() == [[1, 2, 3], [5, v.pad_id, v.pad_id]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.decoder_input.tolist() == [[v.bos_id, 4, v.pad_id], [v.bos_id, 6, 7]]
    assert batch.labels.tolist() == [[4, v.eos_id, -100], [6, 7, v.eos_id]]


def test_batches_resume_exactly_and_bucket_by_length():
    corpus = open_pair_corpus("reverse?size=300")
    it = PairBatches(corpus.pairs("train"), corpus.vocab, batch_size=8, seed=3)
    stream = iter(it)
    for _ in range(50):  # crosses an epoch boundary (38 batches per epoch)
        next(stream)
    state = json.loads(json.dumps(it.state_dict()))
    expected = [next(stream) for _ in range(3)]
    again = PairBatches(corpus.pairs("train"), corpus.vocab, batch_size=8, seed=3)
    again.load_state_dict(state)
    got = [b for _, b in zip(range(3), iter(again))]
    for a, b in zip(expected, got):
        assert torch.equal(a.source, b.source) and torch.equal(a.labels, b.labels)
    padding = sum(int((b.attention_mask == 0).sum()) for b in expected)
    assert padding < sum(b.attention_mask.numel() for b in expected) * 0.25  # bucketing keeps padding low
    with pytest.raises(DataError, match="batch_size"):
        PairBatches(corpus.pairs("train"), corpus.vocab, batch_size=4, seed=3).load_state_dict(state)


def test_reverse_and_spec_errors():
    corpus = open_pair_corpus("reverse?size=100&min_len=3&max_len=5")
    assert all(t == s[::-1] for s, t in corpus.references("train"))
    held_out = {s for s, _ in corpus.references("test")} | {s for s, _ in corpus.references("valid")}
    assert not held_out & {s for s, _ in corpus.references("train")}
    with pytest.raises(DataError, match="min_len=6 is above max_len=5"):
        open_pair_corpus("reverse?min_len=6&max_len=5")
    with pytest.raises(DataError, match="allowed options: size"):
        open_pair_corpus("reverse?tokenizer=bpe")


def test_metrics():
    assert exact_match(["a ", "b"], ["a", "c"]) == 0.5
    assert split_identifier("readConfigFile") == "read config file"
    assert split_identifier("_get_default_name") == "get default name"


SMALL = ["--set", "model.n_layer=1", "--set", "model.n_encoder_layer=1", "--set", "model.d_model=32",
         "--set", "model.n_head=2", "--set", "model.d_head=16", "--set", "model.d_inner=64",
         "--set", "batch_size=16", "--set", "eval_batch_size=50", "--set", "log_interval=2", "--set", "max_minutes=0",
         "--set", "warmup_steps=4", "--set", "lr=0.05", "--set", "beam_size=2", "--quiet",
         "--set", "schedule=inv_sqrt"]  # (cosine's lr depends on max_steps, which the resume test changes)


@pytest.mark.slow
def test_journey_train_resume_eval_generate(tmp_path, capsys):
    data = ["--data", "reverse?size=200&max_len=6"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--preset", "seq2seq-reverse", *data, "--out", str(straight), *SMALL,
                 "--set", "max_steps=12", "--set", "eval_interval=6"]) == 0
    assert main(["train", "--preset", "seq2seq-reverse", *data, "--out", str(split), *SMALL,
                 "--set", "max_steps=6", "--set", "eval_interval=6"]) == 0
    assert main(["train", "--resume", str(split), "--max-steps", "12", "--quiet"]) == 0
    from safetensors.torch import load_file

    a, b = (load_file(run / "last" / "model.safetensors") for run in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resume is exact
    result = json.loads((straight / "result.json").read_text())
    decoded = result["final"]["test"]["decoded"]
    assert [d["method"] for d in decoded] == ["greedy", "beam2"] and decoded[0]["pairs"] == 1000
    capsys.readouterr()
    assert main(["eval", str(straight), "--split", "test", "--max-pairs", "20", "--beam-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] == 20 and 0 <= report["token_accuracy"] <= 1 and len(report["decoded"]) == 2
    (tmp_path / "in.txt").write_text("abc\n\nxyz\n")
    assert main(["generate", str(straight), "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "8"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_cli_errors_are_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "seq2seq-reverse", "--data", "reverse?size=50&max_len=5", "--out", str(run),
                 *SMALL, "--set", "max_steps=2", "--set", "eval_interval=2", "--set", "final_splits=[]"]) == 0
    (tmp_path / "in.txt").write_text("ABC\n")
    capsys.readouterr()
    assert main(["generate", str(run), "--input", str(tmp_path / "in.txt")]) != 0
    assert "in.txt:1" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "abc"]) != 0
    assert "--input FILE" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--data", "reverse", "--out", str(tmp_path / "x"), "--quiet"]) != 0
    assert "encoder-decoder" in capsys.readouterr().err
    assert main(["train", "--preset", "seq2seq-reverse", "--data", "builtin", "--out", str(tmp_path / "x"),
                 "--quiet"]) != 0
    assert "trains on a pair corpus" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
