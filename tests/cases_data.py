"""Bad inputs to the data layer, second round (issue 50): links planted where a download writes, FIFOs
and oversized files in a prepared cache, hostile tar headers, malformed `--url`s and generated corpora
without bounds. Registered into tests/test_robustness.py's table (ids prefixed `data-`)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np

import helpers
from test_robustness import Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401
from txl.errors import DataError

HOSTILE = "tests/test_data_hostile.py::"


@contextlib.contextmanager
def _serving(body: bytes):
    server = helpers.HostileServer()
    server.mode, server.body = "file", body
    try:
        yield server
    finally:
        server.close()


def _wikitext2_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for split in ("train", "valid", "test"):
            zf.writestr(f"wikitext-2/wiki.{split}.tokens", "".join(f" = w{i} = \n" for i in range(50)))
    return buffer.getvalue()


def _outside(ctx: Ctx) -> Path:
    return ctx.write("outside/precious.txt", "must never change\n")


def _download(ctx: Ctx, body: bytes, name: str = "wikitext2") -> Outcome:
    with _serving(body) as server:
        outcome = cli("data", "download", name, "--url", server.url, "--dest", str(ctx.dir / "d"), "--retries", "0",
                      "--timeout", "5", "--sha256", hashlib.sha256(body).hexdigest())
        return Outcome(outcome.text.replace(server.url, "URL"), outcome.code)


@case("data-dl-part-symlink", "a symbolic link planted as the download's `.part` (aimed outside)",
      "txl data download wikitext2 --dest DIR", "wikitext-2-v1.zip.part", "symbolic link", "remove",
      test=HOSTILE + "test_a_planted_archive_part_is_not_written_through")
def _(ctx):
    target = _outside(ctx)
    (ctx.dir / "d").mkdir()
    os.symlink(target, ctx.dir / "d" / "wikitext-2-v1.zip.part")
    outcome = _download(ctx, _wikitext2_zip())
    assert target.read_text() == "must never change\n"
    return outcome


@case("data-dl-part-hardlink", "a hard link planted as the download's `.part`", "txl data download wikitext2 --dest DIR",
      "wikitext-2-v1.zip.part", "hard links", "remove",
      test=HOSTILE + "test_a_planted_archive_part_is_not_written_through")
def _(ctx):
    target = _outside(ctx)
    (ctx.dir / "d").mkdir()
    os.link(target, ctx.dir / "d" / "wikitext-2-v1.zip.part")
    outcome = _download(ctx, _wikitext2_zip())
    assert target.read_text() == "must never change\n"
    return outcome


@case("data-dl-archive-symlink", "a symbolic link planted as the kept archive", "txl data download wikitext2 --dest DIR",
      "symbolic link", "replace the link", test=HOSTILE + "test_a_planted_link_as_the_kept_archive_is_refused")
def _(ctx):
    target = _outside(ctx)
    (ctx.dir / "d").mkdir()
    os.symlink(target, ctx.dir / "d" / "wikitext-2-v1.zip")
    return _download(ctx, _wikitext2_zip())


@case("data-dl-url-malformed", "a malformed `--url` (`http://[::1`)", "txl data download wikitext2 --url 'http://[::1'",
      "--url", "https://HOST", test=HOSTILE + "test_a_malformed_url_is_one_line")
def _(ctx):
    return cli("data", "download", "wikitext2", "--url", "http://[::1", "--dest", str(ctx.dir / "d"))


@case("data-dl-url-scheme", "a `--url` that is not http(s) (`file:///etc/passwd`)",
      "txl data download wikitext2 --url file:///etc/passwd", "scheme file:", "https://",
      test=HOSTILE + "test_a_malformed_url_is_one_line")
def _(ctx):
    return cli("data", "download", "wikitext2", "--url", "file:///etc/passwd", "--dest", str(ctx.dir / "d"))


def _tar_with_header(kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo("././@PaxHeader" if kind == b"x" else "././@LongLink")
    info.type, info.size = kind, size
    return gzip.compress(info.tobuf(format=tarfile.USTAR_FORMAT) + bytes(size) + bytes(-size % 512) + bytes(1024),
                         compresslevel=9)


@case("data-tar-pax-header", "a 50 KB tgz whose PAX header claims 48 MiB", "txl data download ptb --url URL --sha256 H",
      "tar header of 48 MiB", "not a published archive",
      test=HOSTILE + "test_a_huge_archive_header_is_refused_before_it_is_read")
def _(ctx):
    return _download(ctx, _tar_with_header(b"x", 48 << 20), name="ptb")


@case("data-tar-long-name", "a tgz whose GNU long-name header claims 48 MiB", "txl data download ptb --url URL --sha256 H",
      "tar header of 48 MiB", "not a published archive",
      test=HOSTILE + "test_a_huge_archive_header_is_refused_before_it_is_read")
def _(ctx):
    return _download(ctx, _tar_with_header(b"L", 48 << 20), name="ptb")


def _prepared(ctx: Ctx):
    from txl.data import open_corpus

    ctx.own_cache()
    path = ctx.write("c.txt", "".join(f"w{i % 50} w{i % 7} w{i % 3}\n" for i in range(400)))
    spec = f"text:{path}"
    return spec, open_corpus(spec)


@case("data-cache-meta-fifo", "a FIFO as a prepared cache's meta.json", "txl data stats SPEC", "meta.json", "FIFO",
      "--force", test=HOSTILE + "test_a_fifo_as_cache_meta_does_not_hang_stats")
def _(ctx):
    spec, corpus = _prepared(ctx)
    (corpus.path / "meta.json").unlink()
    os.mkfifo(corpus.path / "meta.json")
    return cli("data", "stats", spec)


@case("data-cache-meta-huge", "a prepared cache's meta.json of 1 GiB (sparse)", "txl data stats SPEC",
      "meta.json", "1 GiB", "--force", test=HOSTILE + "test_an_oversized_meta_is_refused_unread")
def _(ctx):
    spec, corpus = _prepared(ctx)
    os.truncate(corpus.path / "meta.json", 1 << 30)
    return cli("data", "stats", spec)


@case("data-cache-npy-claims-3gib", "a prepared array whose header claims 3 GiB on a 1 MiB sparse file",
      "open_corpus(SPEC).split('train')", "claims 3 GiB", "unreadable", "--force",
      test=HOSTILE + "test_an_npy_header_claiming_more_than_the_file_holds_is_refused")
def _(ctx):
    spec, corpus = _prepared(ctx)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (3 << 30,)})
    npy = corpus.path / "train.npy"
    npy.write_bytes(header.getvalue())
    os.truncate(npy, len(header.getvalue()) + (1 << 20))
    from txl.data import open_corpus

    return api(lambda: open_corpus(spec).split("train"), DataError)


@case("data-cache-npy-symlink", "a prepared array replaced by a link to another file", "open_corpus(SPEC).split('train')",
      "symbolic link", "--force", test=HOSTILE + "test_a_linked_cache_array_is_refused")
def _(ctx):
    spec, corpus = _prepared(ctx)
    npy = corpus.path / "train.npy"
    elsewhere = ctx.dir / "elsewhere.npy"
    elsewhere.write_bytes(npy.read_bytes())
    npy.unlink()
    os.symlink(elsewhere, npy)
    from txl.data import open_corpus

    return api(lambda: open_corpus(spec).split("train"), DataError)


@case("data-cache-lock-hardlink", "a hard link planted as a corpus's cache lock", "txl data prepare SPEC --force",
      "cache lock", "hard links", "remove")
def _(ctx):
    spec, corpus = _prepared(ctx)
    lock = corpus.path.parent / f".{corpus.path.name}.lock"
    target = _outside(ctx)
    lock.unlink()
    os.link(target, lock)
    outcome = cli("data", "prepare", spec, "--force")
    assert target.read_text() == "must never change\n"
    return Outcome(outcome.text.replace(corpus.path.name, "text-KEY"), outcome.code)  # the key hashes DIR


@case("data-vocab-fifo", "a FIFO given as `--vocab`", "txl data stats SPEC --vocab FIFO", "FIFO", "regular file")
def _(ctx):
    spec, _ = _prepared(ctx)
    fifo = ctx.dir / "vocab.json"
    os.mkfifo(fifo)
    return cli("data", "stats", spec, "--vocab", str(fifo))


@case("data-pairs-fifo", "a FIFO as a pairs file", "txl data stats pairs:FIFO.tsv", "FIFO", "regular file")
def _(ctx):
    fifo = ctx.dir / "pairs.tsv"
    os.mkfifo(fifo)
    return cli("data", "stats", f"pairs:{fifo}")


@case("data-reverse-size", "a generated corpus of 10^9 pairs", "txl data stats 'reverse?size=1000000000'",
      "size", "at most 1,000,000", test=HOSTILE + "test_generated_corpus_sizes_are_bounded")
def _(ctx):
    return cli("data", "stats", "reverse?size=1000000000")


@case("data-reverse-chars", "a generated corpus of 10^6 pairs of 4096 characters",
      "txl data stats 'reverse?size=1000000&max_len=4096'", "too large", "lower size or max_len",
      test=HOSTILE + "test_generated_corpus_sizes_are_bounded")
def _(ctx):
    return cli("data", "stats", "reverse?size=1000000&max_len=4096")
