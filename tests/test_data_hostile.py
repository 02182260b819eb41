"""Hostile inputs to the data layer (issue 50): links planted where a download writes, non-regular and
oversized cache files, archive headers that cost gigabytes, a corpus line that stalls BPE, unbounded
generated corpora and the temporaries a killed `txl data prepare` leaves.

Every write is checked by its effect outside the directory (the file a link points at stays
byte-identical); every bound by work or memory (tracemalloc), never by time. Subprocess timeouts are
hang guards only.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import threading
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from txl.data import download, open_corpus
from txl.data.corpus import Corpus
from txl.errors import DataError

HANG_GUARD = 120  # seconds; only ever reached when a read blocks for ever


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")


class Server:
    """Serves `files[path] = bytes` on 127.0.0.1, with HTTP Range support."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404, "Not Found")
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_error(416, "Range Not Satisfiable")
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                self.wfile.write(data[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wikitext2_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for split in ("train", "valid", "test"):
            zf.writestr(f"wikitext-2/wiki.{split}.tokens", "".join(f" = w{i} w{i % 7} = \n" for i in range(200)))
    return buffer.getvalue()


OUTSIDE = b"a file outside the download directory; it must never change\n"


def outside_file(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(OUTSIDE)
    return path


# ---------------------------------------------------------------------------------------------
# Downloads: nothing is written through a link planted in the destination


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_planted_archive_part_is_not_written_through(tmp_path, server, link):
    archive = wikitext2_zip()
    server.files["/w.zip"] = archive
    dest = tmp_path / "dest"
    dest.mkdir()
    target = outside_file(tmp_path)
    part = dest / "wikitext-2-v1.zip.part"
    (os.symlink if link == "symlink" else os.link)(target, part)
    with pytest.raises(DataError) as err:
        download("wikitext2", dest, url=server.url("/w.zip"), sha256=sha(archive), backoff=0)
    assert target.read_bytes() == OUTSIDE
    assert "wikitext-2-v1.zip.part" in str(err.value) and "\n" not in str(err.value)
    assert not (dest / "wiki.train.tokens").exists()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_planted_member_temporary_is_not_written_through(tmp_path, server, link):
    archive = wikitext2_zip()
    server.files["/w.zip"] = archive
    dest = tmp_path / "dest"
    dest.mkdir()
    target = outside_file(tmp_path)
    planted = dest / "wiki.train.tokens.part"
    (os.symlink if link == "symlink" else os.link)(target, planted)
    download("wikitext2", dest, url=server.url("/w.zip"), sha256=sha(archive), backoff=0)
    assert target.read_bytes() == OUTSIDE
    final = dest / "wiki.train.tokens"
    assert final.is_file() and not final.is_symlink() and os.stat(final).st_nlink == 1
    assert final.read_bytes().startswith(b" = w0 w0 = \n")
    assert not any(p.name.startswith(".txl-extract") for p in dest.iterdir())


def test_a_planted_link_as_the_kept_archive_is_refused(tmp_path, server):
    archive = wikitext2_zip()
    server.files["/w.zip"] = archive
    dest = tmp_path / "dest"
    dest.mkdir()
    target = outside_file(tmp_path)
    os.symlink(target, dest / "wikitext-2-v1.zip")
    with pytest.raises(DataError, match="symbolic link"):
        download("wikitext2", dest, url=server.url("/w.zip"), sha256=sha(archive), backoff=0)
    assert target.read_bytes() == OUTSIDE


def test_a_stale_extract_directory_of_a_dead_process_is_removed(tmp_path, server):
    archive = wikitext2_zip()
    server.files["/w.zip"] = archive
    dest = tmp_path / "dest"
    stale = dest / ".txl-extract-999999999-abcdef"
    stale.mkdir(parents=True)
    (stale / "wiki.train.tokens").write_bytes(b"half")
    download("wikitext2", dest, url=server.url("/w.zip"), sha256=sha(archive), backoff=0)
    assert not stale.exists()


@pytest.mark.parametrize("url", ["http://[::1", "notaurl", "ftp://127.0.0.1/x.zip", "file:///etc/hostname",
                                 "http://", "http://127.0.0.1:99999/x", "http://a b/x"])
def test_a_malformed_url_is_one_line(tmp_path, url):
    with pytest.raises(DataError) as err:
        download("wikitext2", tmp_path / "dest", url=url, retries=0, timeout=2)
    message = str(err.value)
    assert "--url" in message and "\n" not in message and "http" in message
    assert not (tmp_path / "dest" / "wikitext-2-v1.zip.part").exists()


# ---------------------------------------------------------------------------------------------
# Archives: PAX and GNU long-name headers are bounded before tarfile reads them


def tar_with_header(kind: bytes, size: int) -> bytes:
    """A gzipped tar whose first entry is a PAX ('x') or GNU long-name ('L') header of `size` bytes
    (zeros: tiny once compressed), followed by an ordinary member."""
    info = tarfile.TarInfo("././@PaxHeader" if kind == b"x" else "././@LongLink")
    info.type = kind
    info.size = size
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    body = bytes(size) + bytes(-size % 512)
    tail = io.BytesIO()
    with tarfile.open(fileobj=tail, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        member = tarfile.TarInfo("simple-examples/data/ptb.train.txt")
        member.size = 4
        tf.addfile(member, io.BytesIO(b"a b\n"))
    return gzip.compress(header + body + tail.getvalue(), compresslevel=9)


@pytest.mark.parametrize("kind", [b"x", b"L"])
def test_a_huge_archive_header_is_refused_before_it_is_read(tmp_path, server, kind):
    size = 48 << 20  # 48 MiB of header: tarfile would read it whole (the review's 400 MB cost 1.2 GB)
    archive = tar_with_header(kind, size)
    assert len(archive) < 200_000
    server.files["/s.tgz"] = archive
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            download("ptb", tmp_path / "dest", url=server.url("/s.tgz"), sha256=sha(archive), backoff=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "header" in str(err.value) and "\n" not in str(err.value)
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_many_long_headers_are_bounded_in_total(tmp_path):
    from txl.data import fetch

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(40):
            member = tarfile.TarInfo(f"d/{i:04d}" + "x" * 60_000)  # a 60 KB name each: a PAX header
            tf.addfile(member, io.BytesIO(b""))
    path = tmp_path / "many.tar"
    path.write_bytes(raw.getvalue())
    with pytest.raises(DataError, match="header"), fetch.bounded_tar(path, header_limit=1 << 20,
                                                                     total_limit=1 << 20) as tf:
        for _ in tf:
            pass


@pytest.mark.parametrize("sparse", ["gnu", "pax-1.0"])
def test_a_sparse_member_is_refused(tmp_path, sparse):
    """tarfile gathers a sparse member's map in memory (1.0: read from the member's data, as long as it
    claims); the published archives hold no sparse members."""
    from txl.data import fetch

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT if sparse == "gnu" else tarfile.PAX_FORMAT) as tf:
        member = tarfile.TarInfo("simple-examples/data/ptb.train.txt")
        if sparse == "gnu":
            member.type = tarfile.GNUTYPE_SPARSE
        else:
            member.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                  "GNU.sparse.name": "ptb.train.txt", "GNU.sparse.realsize": "1"}
        member.size = 512
        tf.addfile(member, io.BytesIO(b"9" * 511 + b"\n"))
    path = tmp_path / "sparse.tar"
    path.write_bytes(raw.getvalue())
    with pytest.raises(DataError, match="sparse member"), fetch.bounded_tar(path) as tf:
        for _ in tf:
            pass


def test_an_ordinary_pax_tar_still_reads(tmp_path):
    from txl.data import fetch

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tf:
        member = tarfile.TarInfo("simple-examples/data/" + "é" * 20 + ".txt")  # non-ASCII: a PAX header
        member.size = 3
        tf.addfile(member, io.BytesIO(b"abc"))
    path = tmp_path / "ok.tgz"
    path.write_bytes(raw.getvalue())
    with fetch.bounded_tar(path) as tf:
        assert [m.name for m in tf] == ["simple-examples/data/" + "é" * 20 + ".txt"]


# ---------------------------------------------------------------------------------------------
# The prepared cache: meta.json and .npy are regular, bounded and checked before use


def prepared(tmp_path: Path, tokenizer: str = "bytes"):
    path = tmp_path / "c.txt"
    path.write_text("".join(f"w{i % 50} w{i % 7} w{i % 3}\n" for i in range(400)))
    spec = f"text:{path}?tokenizer={tokenizer}"
    return spec, open_corpus(spec)


def run_cli(*argv: str, timeout: float = HANG_GUARD) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "txl.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert ": error: " in lines[-1] and sum(": error: " in line for line in lines) == 1, proc.stderr
    return lines[-1]


@pytest.mark.slow
def test_a_fifo_as_cache_meta_does_not_hang_stats(tmp_path):
    spec, corpus = prepared(tmp_path)
    meta = corpus.path / "meta.json"
    meta.unlink()
    os.mkfifo(meta)
    line = one_error_line(run_cli("data", "stats", spec))
    assert "meta.json" in line and "FIFO" in line and "--force" in line


@pytest.mark.slow
def test_a_fifo_as_cache_array_is_prepared_again_not_read(tmp_path):
    """A FIFO where an array was is treated as a missing array: the cache is prepared again (opening the
    FIFO would block for ever)."""
    spec, corpus = prepared(tmp_path)
    expected = np.asarray(corpus.split("train")).copy()
    npy = corpus.path / "train.npy"
    npy.unlink()
    os.mkfifo(npy)
    code = f"""
        from txl.data import open_corpus
        print("tokens", len(open_corpus({spec!r}).split("train")))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=HANG_GUARD)
    assert proc.stdout.strip() == f"tokens {len(expected)}", proc.stdout + proc.stderr


@pytest.mark.parametrize("tokenizer", ["bytes", "words"])
@pytest.mark.slow
def test_a_fifo_as_the_corpus_is_one_line(tmp_path, tokenizer):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    line = one_error_line(run_cli("data", "prepare", f"text:{fifo}?tokenizer={tokenizer}"))
    assert "not a regular file" in line and "corpus.txt" in line


def test_a_linked_cache_array_is_refused(tmp_path):
    spec, corpus = prepared(tmp_path)
    npy = corpus.path / "train.npy"
    elsewhere = tmp_path / "elsewhere.npy"
    np.save(elsewhere, np.arange(corpus.num_tokens("train"), dtype=np.uint8) % 50)
    npy.unlink()
    os.symlink(elsewhere, npy)
    with pytest.raises(DataError, match="symbolic link"):
        open_corpus(spec).split("train")


def npy_header(claimed: int) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (claimed,)})
    return header.getvalue()


def claim_tokens(corpus, claimed: int) -> None:
    meta = json.loads((corpus.path / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] = claimed  # the meta agrees with the header
    (corpus.path / "meta.json").write_text(json.dumps(meta))


def test_an_npy_header_claiming_more_than_the_file_holds_is_refused(tmp_path):
    spec, corpus = prepared(tmp_path)
    npy = corpus.path / "train.npy"
    claimed = 3 << 30
    claim_tokens(corpus, claimed)
    header = npy_header(claimed)
    with open(npy, "wb") as f:  # a sparse file: the header, then a hole of 1 MiB
        f.write(header)
        f.truncate(len(header) + (1 << 20))
    reopened = Corpus(corpus.path, json.loads((corpus.path / "meta.json").read_text()), spec)
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:
            reopened.split("train")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "3 GiB" in str(err.value) and "--force" in str(err.value)
    assert peak < 16 << 20


def test_a_sparse_3_gib_array_for_a_small_corpus_is_prepared_again(tmp_path):
    """Header, meta and file size all agree on 3 GiB of tokens, but the sources hold 8 KB: no
    tokenizer makes more than two tokens per source byte, so the cache is not trusted."""
    spec, corpus = prepared(tmp_path)
    expected = corpus.num_tokens("train")
    npy = corpus.path / "train.npy"
    claimed = 3 << 30
    claim_tokens(corpus, claimed)
    header = npy_header(claimed)
    with open(npy, "wb") as f:
        f.write(header)
        f.truncate(len(header) + claimed)
    assert open_corpus(spec).num_tokens("train") == expected


@pytest.mark.slow
def test_an_oversized_meta_is_refused_unread(tmp_path):
    spec, corpus = prepared(tmp_path)
    meta = corpus.path / "meta.json"
    with open(meta, "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB claimed, nothing on disk
    line = one_error_line(run_cli("data", "stats", spec))
    assert "meta.json" in line and "--force" in line


# ---------------------------------------------------------------------------------------------
# BPE: a line without whitespace is cut before the tokenizer sees it


def test_bpe_pieces_bound_every_run_and_keep_the_text():
    from txl.data.vocab import bpe_pieces

    text = "short words here\n" + "a" * 2500 + " " * 1300 + "tail\n" + "b" * 999
    pieces = list(bpe_pieces(text, limit=1000))
    assert "".join(pieces) == text
    for piece in pieces:
        assert max(len(run) for run in piece.split()) <= 1000 if piece.split() else True
        assert " " * 1001 not in piece
    assert list(bpe_pieces("ordinary text\n", limit=1000)) == ["ordinary text\n"]


@pytest.mark.slow
def test_bpe_preparation_of_a_corpus_with_one_huge_word(tmp_path):
    pytest.importorskip("tokenizers")
    root = tmp_path / "corpus"
    root.mkdir()
    rng = np.random.default_rng(0)
    normal = "".join(f"w{i % 50} w{i % 7} w{i % 3}\n" for i in range(300))
    huge = "".join(rng.choice(list("abcdefghij"), size=1 << 20))  # 1 MiB without whitespace: hours of BPE training
    (root / "train.txt").write_text(normal + huge + "\n" + normal)
    (root / "valid.txt").write_text(normal)
    (root / "test.txt").write_text(huge[:5000] + "\n" + normal)
    code = f"""
        import numpy as np
        from txl.data import open_corpus
        corpus = open_corpus("text:{root}?tokenizer=bpe&vocab_size=300")
        text = corpus.vocab.decode(np.asarray(corpus.split("test")))
        print("ok", text == open("{root / 'test.txt'}").read())
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=HANG_GUARD * 2, env={**os.environ})
    assert proc.stdout.strip() == "ok True", proc.stdout + proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Generated corpora have an upper bound


@pytest.mark.parametrize("spec", ["reverse?size=1000000000", "reverse?max_len=100000000",
                                  "reverse?size=1000000&max_len=4096", "pairs:x.tsv?vocab_size=1000000000000"])
def test_generated_corpus_sizes_are_bounded(spec):
    from txl.data.spec import parse_spec

    with pytest.raises(DataError) as err:
        parse_spec(spec)
    assert "at most" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# A killed `txl data prepare` leaves a temporary directory; the next run removes it


def test_a_killed_prepare_leaves_nothing_after_the_next_run(tmp_path):
    from txl.data.corpus import cache_key
    from txl.data.readers import make_plan
    from txl.data.spec import parse_spec

    path = tmp_path / "c.txt"
    path.write_text("".join(f"w{i % 50} w{i % 7} w{i % 3}\n" for i in range(400)))
    spec = f"text:{path}?tokenizer=words"
    key = cache_key(make_plan(parse_spec(spec)))
    root = tmp_path / "cache" / "corpora"
    root.mkdir(parents=True)
    stale = root / f".{key}.tmp-999999999-abc123"  # what the killed run left
    stale.mkdir()
    (stale / "train.npy").write_bytes(b"half an array")
    old = root / f".{key}.old-999999999-abc123"  # killed between the two renames of replace_dir
    old.mkdir()
    other = root / ".text-0123456789abcdef.tmp-999999999-def456"  # another corpus's, nobody preparing it
    other.mkdir()
    unrelated = root / "notes"  # not of our naming: kept
    unrelated.mkdir()
    target = outside_file(tmp_path)
    planted = root / f".{key}.tmp-999999998-0000aa"  # a link of our naming: removed as a link, never followed
    os.symlink(target.parent, planted)
    open_corpus(spec)
    assert not stale.exists() and not old.exists() and not other.exists()
    assert unrelated.is_dir() and target.read_bytes() == OUTSIDE
    assert not any(p.name.startswith(f".{key}.tmp") for p in root.iterdir())


@pytest.mark.slow
def test_a_temporary_in_use_by_another_prepare_is_kept(tmp_path):
    """The other process holds the corpus's lock: its temporary directory is not touched."""
    root = tmp_path / "cache" / "corpora"
    root.mkdir(parents=True)
    busy = root / ".text-0123456789abcdef.tmp-999999999-abc123"
    busy.mkdir()
    lock = root / ".text-0123456789abcdef.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            f = open({str(lock)!r}, "a+b")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            print("locked", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        path = tmp_path / "c.txt"
        path.write_text("".join(f"w{i % 50} w{i % 7}\n" for i in range(400)))
        open_corpus(f"text:{path}")
        assert busy.is_dir()
    finally:
        holder.stdin.close()
        holder.wait(timeout=HANG_GUARD)
