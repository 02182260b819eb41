"""Run directories and inputs from strangers (issue 17): each test here failed before the fix.

- links planted in a run directory (sample.txt, metrics.jsonl, the temporaries of run.json, the
  crash-recovery entries `.best.old-*` / `.last.old-*`, `best` / `last` themselves) are refused by name
  and every file outside the run stays byte-identical;
- one writer per run: two `txl train` on one --out, ten times over: one finishes with a resumable
  `last/`, the other exits at once with one line naming the holder; a killed holder never blocks;
- a config.json far larger than its weights fails before allocating (peak RSS measured);
- duplicate keys in config.json and safetensors headers are errors;
- sampling and evaluation ranges, non-finite weights, BPE tokenizers that are not txl's own;
- the downloader's limits hold while streaming, against a server on 127.0.0.1.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import helpers
from helpers import TINY, call, one_error_line
from txl.errors import CheckpointError, DataError, UsageError
from txl.models.pretrained import load_tensors, save_tensors

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root` (links not followed): its bytes, its link target, or 'dir'."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = ("link", os.readlink(path))
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = path.read_bytes()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """A finished tiny run (last/, best/, run.json, metrics.jsonl, result.json)."""
    root = tmp_path_factory.mktemp("trained")
    config = helpers.write_config(root, corpus, steps=2, varlen="false")
    code, err = call("train", "--config", str(config), "--out", str(root / "run"), "--quiet", *TINY)
    assert code == 0, err
    return root / "run"


@pytest.fixture
def victim(tmp_path) -> Path:
    """Files outside the run that a hostile run directory points at."""
    home = tmp_path / "home"
    (home / "work" / "best").mkdir(parents=True)
    (home / "work" / "last").mkdir(parents=True)
    (home / ".bashrc").write_text("export PATH=/usr/bin\n")
    (home / "notes.txt").write_text("my notes\n")
    for name in ("best", "last"):
        (home / "work" / name / "config.json").write_text('{"mine": true}\n')
        (home / "work" / name / "data.bin").write_bytes(b"\x00\x01" * 100)
    return home


def _run_copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


def _want_sample(run: Path, prompt: str = "echo pwned; ") -> None:
    """What the review did: ask the resumed run for a sample (edited into last/trainer_state.json)."""
    path = run / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    state["run"]["train"]["sample_tokens"] = 8
    state["run"]["train"]["sample_prompt"] = prompt
    path.write_text(json.dumps(state))


def _plant(kind: str, run: Path, victim: Path) -> str:
    """Plant one attack; returns the entry name the error must name."""
    if kind == "sample":
        _want_sample(run)
        (run / "sample.txt").symlink_to(victim / ".bashrc")
        return "sample.txt"
    if kind == "metrics":
        (run / "metrics.jsonl").unlink()
        (run / "metrics.jsonl").symlink_to(victim / "notes.txt")
        return "metrics.jsonl"
    if kind == "run-json-tmp":  # the temporary name the old run.json writer opened
        (run / ".run.json.tmp").symlink_to(victim / ".bashrc")
        return ".run.json.tmp"
    if kind == "result-json":
        (run / "result.json").unlink()
        (run / "result.json").symlink_to(victim / "notes.txt")
        return "result.json"
    if kind == "best-old":  # recovery would have moved a folder outside the run (the link target) into it, then deleted it
        shutil.rmtree(run / "best")
        (run / ".best.old-x1").symlink_to(victim / "work")
        return ".best.old-x1"
    if kind == "last-old":
        shutil.move(run / "last", run / "last-saved")
        (run / ".last.old-x1").symlink_to(victim / "work")
        return ".last.old-x1"
    if kind == "last-old-inner":  # a real recovery directory whose entry is a link
        shutil.move(run / "last", run / "last-saved")
        (run / ".last.old-x2").mkdir()
        (run / ".last.old-x2" / "last").symlink_to(victim / "work" / "last")
        return ".last.old-x2/last"
    if kind in ("best", "last"):
        shutil.rmtree(run / kind) if kind == "best" else shutil.move(run / "last", run / "last-saved")
        (run / kind).symlink_to(victim / "work" / kind)
        return kind
    if kind == "lock":
        (run / ".txl-lock").unlink(missing_ok=True)
        (run / ".txl-lock").symlink_to(victim / ".bashrc")
        return ".txl-lock"
    raise AssertionError(kind)


ATTACKS = ["sample", "metrics", "run-json-tmp", "result-json", "best-old", "last-old", "last-old-inner", "best",
           "last", "lock"]


@pytest.mark.parametrize("kind", ATTACKS)
def test_a_link_in_a_resumed_run_is_refused_and_nothing_outside_changes(kind, trained, victim, tmp_path):
    run = _run_copy(trained, tmp_path)
    entry = _plant(kind, run, victim)
    before = snapshot(victim)
    code, err = call("train", "--resume", str(run), "--max-steps", "3", "--quiet")
    line = one_error_line(err)
    assert code == 2 and entry.split("/")[-1] in line and "symbolic link" in line, line
    assert snapshot(victim) == before


def test_the_old_metrics_temporary_name_is_not_written_through(trained, victim, tmp_path):
    run = _run_copy(trained, tmp_path)
    (run / "metrics.tmp").symlink_to(victim / ".bashrc")  # the name the old metrics truncation wrote
    _want_sample(run, "hello")
    before = snapshot(victim)
    code, err = call("train", "--resume", str(run), "--max-steps", "3", "--quiet")
    assert code == 0, err
    assert snapshot(victim) == before
    assert (run / "sample.txt").is_file() and not (run / "sample.txt").is_symlink()


def test_plot_and_eval_outputs_are_not_written_through_links(trained, victim, tmp_path):
    run = _run_copy(trained, tmp_path)
    (run / "curves.png").symlink_to(victim / ".bashrc")
    before = snapshot(victim)
    code, err = call("plot", str(run))
    assert code == 2 and "curves.png" in one_error_line(err)
    (tmp_path / "sweep.md").symlink_to(victim / "notes.txt")
    code, err = call("eval", str(run), "--sweep-mem", "0,4", "--sweep-out", str(tmp_path / "sweep"),
                     "--max-tokens", "64", "--device", "cpu", "--quiet")
    assert code == 2 and "sweep.md" in one_error_line(err)
    assert snapshot(victim) == before


# ---------------------------------------------------------------------------------------------
# New runs: an --out that is not a run, and non-UTF-8 paths


def test_out_into_a_directory_of_user_files_is_refused_unless_forced(tmp_path, corpus):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.jsonl").write_text("my own metrics\n")
    (out / "thesis.tex").write_text("chapter 1\n")
    before = snapshot(out)
    config = helpers.write_config(tmp_path, corpus, steps=1, varlen="false")
    code, err = call("train", "--config", str(config), "--out", str(out), "--quiet", *TINY)
    line = one_error_line(err)
    assert code == 2 and "--force" in line and "did not write" in line
    assert snapshot(out) == before
    code, err = call("train", "--config", str(config), "--out", str(out), "--quiet", "--force", *TINY)
    assert code == 0, err
    assert (out / "thesis.tex").read_text() == "chapter 1\n" and (out / "last").is_dir()


def test_a_non_utf8_out_path_is_refused_before_training(tmp_path, corpus):
    config = helpers.write_config(tmp_path, corpus, steps=1, varlen="false")
    out = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/run-\xff"))
    code, err = call("train", "--config", str(config), "--out", str(out), "--quiet", *TINY)
    line = one_error_line(err)
    assert code == 2 and "UTF-8" in line
    assert not os.path.exists(out)


# ---------------------------------------------------------------------------------------------
# One writer per run


@pytest.mark.slow
def test_two_trainings_on_one_out_ten_trials(tmp_path, corpus):
    """Both start at once; the lock lets exactly one through; its last/ resumes."""
    config = helpers.write_config(tmp_path, corpus, steps=6, varlen="false")
    for trial in range(10):
        out = tmp_path / f"run{trial}"
        args = ("train", "--config", str(config), "--out", str(out), "--quiet", *TINY)
        procs = [helpers.txl(*args) for _ in range(2)]
        results = [helpers.finish(p) for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 2], f"trial {trial}: {results}"
        loser = next(text for code, text in results if code == 2)
        line = one_error_line(loser)
        # the loser meets the lock, or, when it started after the winner had finished (a loaded machine),
        # the finished run: both are one line naming the cause
        assert "in use by another txl process (pid " in line or "already holds a run; continue it with --resume" \
            in line, line
        assert helpers.saved_step(out) == 6
        code, text = helpers.finish(helpers.txl("train", "--resume", str(out), "--max-steps", "7", "--quiet"))
        assert code == 0 and helpers.saved_step(out) == 7, text


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_never_blocks(tmp_path):
    from txl.io.rundir import RunLock

    run = tmp_path / "run"
    run.mkdir()
    hold = ("import sys, time; from txl.io.rundir import RunLock; RunLock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"in use by another txl process \(pid {proc.pid}\)"):
            RunLock.acquire(run)
    finally:
        proc.kill()  # SIGKILL: no clean-up runs, the lock file stays
        proc.wait()
    assert (run / ".txl-lock").is_file()
    lock = RunLock.acquire(run)  # the kernel dropped the dead holder's lock
    lock.release()


# ---------------------------------------------------------------------------------------------
# Check before allocating


def _checkpoint(trained: Path, tmp_path: Path, **config_changes) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "last", ckpt)
    if config_changes:
        data = json.loads((ckpt / "config.json").read_text())
        data.update(config_changes)
        (ckpt / "config.json").write_text(json.dumps(data))
    return ckpt


# Started from a small launcher: Linux counts a child's RSS before exec (a fork of this large pytest
# process) into its peak, so the child must be forked from something small to measure txl alone.
LAUNCHER = r"""
import json, os, subprocess, sys, time
start = time.monotonic()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read().decode()
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "err": err, "seconds": time.monotonic() - start,
                  "rss_mb": usage.ru_maxrss / 1024}))
"""


def _run_measured(*args: str) -> tuple[int, str, float, float]:
    """A `python -m txl` process: (exit code, stderr, seconds, peak RSS in MB) of that process alone."""
    out = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "txl", *args], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    got = json.loads(out)
    return got["code"], got["err"], got["seconds"], got["rss_mb"]


@pytest.mark.parametrize("changes", [{"n_layer": 1_000_000_000}, {"n_layer": 1024, "d_model": 4096, "d_head": 512,
                                                                   "n_head": 8, "d_inner": 16384}],
                         ids=["n_layer-1e9", "within-bounds-but-1024-layers"])
@pytest.mark.slow
def test_a_config_bomb_fails_before_allocating(changes, trained, tmp_path):
    ckpt = _checkpoint(trained, tmp_path, **changes)
    code, err, seconds, rss_mb = _run_measured("eval", str(ckpt), "--device", "cpu", "--quiet")
    line = one_error_line(err)
    assert code == 2 and ("n_layer" in line or "parameters" in line), line
    assert rss_mb < 500, f"peak RSS {rss_mb:.0f} MB"
    print(f"\nconfig bomb {changes}: exit {code} in {seconds:.2f} s, peak RSS {rss_mb:.0f} MB: {line}")


def test_duplicate_keys_in_config_json_are_an_error(trained, tmp_path):
    from txl.models.transformer_xl.model import TransformerXL

    ckpt = _checkpoint(trained, tmp_path)
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace('"n_layer": 1,', '"n_layer": 1, "n_layer": 1000000000,'))
    with pytest.raises(CheckpointError, match="'n_layer' appears twice"):
        TransformerXL.from_pretrained(ckpt)


def _safetensors_with_header(path: Path, header_text: str, body: bytes) -> None:
    raw = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_duplicate_tensor_names_in_a_safetensors_header_are_an_error(tmp_path):
    path = tmp_path / "w.safetensors"
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    _safetensors_with_header(path, f'{{"w": {entry}, "w": {entry}}}', b"\x00" * 4)
    with pytest.raises(CheckpointError, match="'w' appears twice"):
        load_tensors(path)


def test_weights_header_is_compared_before_the_model_is_built(trained, tmp_path, monkeypatch):
    import txl.models.transformer_xl.model

    ckpt = _checkpoint(trained, tmp_path, d_inner=64)
    built = []
    real_init = txl.models.transformer_xl.model.TransformerXL.__init__

    def counting_init(self, config):
        built.append(str(torch.empty(0).device))  # the default device: meta while shapes are compared
        real_init(self, config)

    monkeypatch.setattr(txl.models.transformer_xl.model.TransformerXL, "__init__", counting_init)
    with pytest.raises(CheckpointError, match="fc1|ff|shape"):
        txl.models.transformer_xl.model.TransformerXL.from_pretrained(ckpt)
    assert built == ["meta"]


def test_the_out_of_memory_reporter_cannot_raise(capfd):
    from txl.cli.main import _report_out_of_memory

    class Exhausted(MemoryError):
        def __str__(self):
            raise MemoryError  # even describing the error needs memory

    assert _report_out_of_memory(Exhausted(), "txl eval", "eval") is True
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "out of memory" in err
    assert _report_out_of_memory(ValueError("x"), "txl eval", "eval") is False


# ---------------------------------------------------------------------------------------------
# Sampling, evaluation and non-finite weights


def _poisoned(trained: Path, tmp_path: Path, value: float) -> Path:
    ckpt = _checkpoint(trained, tmp_path)
    tensors, meta = load_tensors(ckpt / "model.safetensors")
    name = next(k for k in tensors if k.endswith("weight") and tensors[k].dim() == 2)
    tensors[name] = torch.full_like(tensors[name], value)
    save_tensors(ckpt / "model.safetensors", tensors, {"txl_kind": meta.get("txl_kind", "model")})
    return ckpt


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_weights_end_in_one_line(value, trained, tmp_path):
    ckpt = _poisoned(trained, tmp_path, value)
    code, err = call("generate", str(ckpt), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu")
    assert code == 2 and "not finite" in one_error_line(err)
    code, err = call("eval", str(ckpt), "--max-tokens", "64", "--device", "cpu", "--quiet")
    assert code == 2 and "non-finite" in one_error_line(err)
    code, err = call("eval", str(ckpt), "--max-tokens", "64", "--device", "cpu", "--quiet", "--allow-nonfinite")
    assert code == 0, err


@pytest.mark.parametrize("argv", [
    ["--temperature", "nan"], ["--temperature", "1e-40"], ["--temperature", "inf"], ["--top-p", "1e-300"],
    ["--top-p", "nan"], ["--seed", str(10**29)], ["--mem-len", str(10**24)], ["--max-new-tokens", str(10**30)],
], ids=lambda a: " ".join(a))
def test_generate_values_out_of_range_end_in_one_line(argv, trained):
    code, err = call("generate", str(trained), "--prompt", "the", "--device", "cpu", *argv)
    assert code == 2, err
    one_error_line(err)


@pytest.mark.parametrize("argv", [
    ["--clamp-len", str(10**24)], ["--mem-len", str(10**24)], ["--sweep-mem", f"0,{10**24}"],
    ["--tgt-len", str(10**30)], ["--max-tokens", str(10**30)],
], ids=lambda a: " ".join(a))
def test_eval_values_out_of_range_end_in_one_line(argv, trained):
    code, err = call("eval", str(trained), "--device", "cpu", "--quiet", *argv)
    assert code == 2, err
    one_error_line(err)


# ---------------------------------------------------------------------------------------------
# Tokenizers from strangers


def _bpe_vocab_json(tmp_path: Path, change) -> Path:
    outer = helpers.stranger_bpe_vocab(change, vocab_size=280)
    outer.pop("size", None)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(outer))
    return path


BPE_ATTACKS = {
    "catastrophic-regex": lambda d: d.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a+)+$"},
                                                            "behavior": "Isolated", "invert": False}),
    "expanding-normalizer": lambda d: d.update(normalizer={"type": "Replace", "pattern": {"String": "a"},
                                                           "content": "a" * 10_000}),
    "post-processor": lambda d: d.update(post_processor={"type": "ByteLevel"}),
    "wordpiece-model": lambda d: d["model"].update(type="WordPiece"),
    "decoder": lambda d: d.update(decoder={"type": "Replace", "pattern": {"String": "a"}, "content": "b"}),
}


@pytest.mark.parametrize("attack", sorted(BPE_ATTACKS))
def test_a_bpe_tokenizer_that_txl_does_not_write_is_refused_before_it_is_built(attack, tmp_path, monkeypatch):
    import tokenizers

    from txl.data.vocab import Vocab

    path = _bpe_vocab_json(tmp_path, BPE_ATTACKS[attack])

    def never(*args):
        raise AssertionError("a stranger's tokenizer JSON reached the Rust library")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", never)
    with pytest.raises(DataError, match="not one txl writes"):
        Vocab.load(path)


def test_txl_own_bpe_vocabulary_still_loads(tmp_path):
    from txl.data.vocab import Vocab

    vocab = Vocab.load(_bpe_vocab_json(tmp_path, lambda d: None))
    assert vocab.decode(vocab.encode("attention is")) == "attention is"


# ---------------------------------------------------------------------------------------------
# Full disks


def test_a_full_disk_while_preparing_a_corpus_is_one_line(tmp_path, monkeypatch):
    import txl.data.cache

    def full(self, ids):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(txl.data.cache.NpyWriter, "write", full)
    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))
    corpus_file = helpers.make_corpus(tmp_path / "c.txt", lines=200)
    code, err = call("data", "prepare", f"text:{corpus_file}")
    line = one_error_line(err)
    assert code == 2 and "no space left" in line
    assert not any(".tmp-" in p.name for p in (tmp_path / "cache").rglob("*"))  # no unfinished cache


# ---------------------------------------------------------------------------------------------
# The downloader, against a server on 127.0.0.1


@pytest.fixture
def hostile():
    server = helpers.HostileServer()
    yield server
    server.close()


def _download(server, dest: Path, name: str = "wikitext2", **kwargs):
    from txl.data import download

    return download(name, dest, url=server.url, backoff=0, retries=1, timeout=5, **kwargs)


def test_download_size_bomb_stops_before_writing(hostile, tmp_path):
    hostile.mode = "bomb"
    with pytest.raises(DataError, match="announces 10,737,418,240 bytes"):
        _download(hostile, tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == []


def test_download_endless_body_stops_at_the_limit(hostile, tmp_path):
    hostile.mode = "endless"
    with pytest.raises(DataError, match="passed 1,048,576 bytes"):
        _download(hostile, tmp_path / "d", max_bytes=1 << 20)
    assert list((tmp_path / "d").iterdir()) == []
    assert hostile.sent < 64 << 20  # the client stopped reading; the server was not drained


def test_download_trickle_is_abandoned_at_the_minimum_rate(hostile, tmp_path):
    hostile.mode = "trickle"
    with pytest.raises(DataError, match="slower than the minimum"):
        _download(hostile, tmp_path / "d", min_rate=100, rate_window=1)
    assert list((tmp_path / "d").iterdir()) == []


def test_download_trickle_is_abandoned_at_the_deadline(hostile, tmp_path):
    hostile.mode = "trickle"
    with pytest.raises(DataError, match="deadline"):
        _download(hostile, tmp_path / "d", deadline=1, min_rate=0)
    assert list((tmp_path / "d").iterdir()) == []


def test_download_zip_bomb_stops_at_the_unpacked_limit(hostile, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("wikitext-2/wiki.train.tokens", b"\0" * (48 << 20))  # wikitext2 unpacks to <= 32 MiB
        zf.writestr("wikitext-2/wiki.valid.tokens", b"a\n")
        zf.writestr("wikitext-2/wiki.test.tokens", b"b\n")
    hostile.body = buffer.getvalue()
    assert len(hostile.body) < 1 << 20
    with pytest.raises(DataError, match="unpacks to more than"):
        _download(hostile, tmp_path / "d", sha256=hashlib.sha256(hostile.body).hexdigest())
    assert list((tmp_path / "d").iterdir()) == []


def test_download_archive_with_too_many_members_is_refused(hostile, tmp_path, monkeypatch):
    import txl.data.fetch

    monkeypatch.setattr(txl.data.fetch, "MAX_MEMBERS", 10)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for i in range(20):
            info = tarfile.TarInfo(f"junk/{i}")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
    hostile.body = buffer.getvalue()
    with pytest.raises(DataError, match="more than 10 entries"):
        _download(hostile, tmp_path / "d", name="ptb", sha256=hashlib.sha256(hostile.body).hexdigest())
    assert list((tmp_path / "d").iterdir()) == []


def test_download_onto_a_full_disk_is_not_a_connection_problem(hostile, tmp_path, monkeypatch):
    import txl.data.fetch

    hostile.body = b"x" * 200_000

    class Full:
        """The `.part` file on a full disk: every write fails with ENOSPC."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):  # seek, truncate, flush, fileno
            return getattr(self.f, name)

    real_stream = txl.data.fetch._stream
    monkeypatch.setattr(txl.data.fetch, "_stream", lambda resp, f, *args: real_stream(resp, Full(f), *args))
    with pytest.raises(DataError, match="no space left on the device") as info:
        _download(hostile, tmp_path / "d")
    assert "connection" not in str(info.value)
    assert list((tmp_path / "d").iterdir()) == []
