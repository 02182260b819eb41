"""The downloader against a loopback HTTP server serving archives generated in the real layouts."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import threading
from pathlib import Path

import pytest
from txl_data_fixtures import enwik8_bytes, make_ptb, tgz_bytes, zip_bytes

from txl.cli.main import main
from txl.data import download, open_corpus
from txl.data.fetch import SOURCES
from txl.errors import DataError


class Server:
    """Serves `files[path] = bytes` with HTTP Range support and scriptable failures.

    mode: "ok"; "drop_once" (first request sends half the bytes, then closes); "drop_always";
    "no_range" (ignores Range, always 200); "corrupt" (flips one byte of the body).
    """

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.mode = "ok"
        self.requests: list[dict] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                data = server.files.get(self.path)
                server.requests.append({"path": self.path, "range": self.headers.get("Range")})
                if data is None:
                    self.send_error(404, "Not Found")
                    return
                if server.mode == "corrupt":
                    data = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
                start = 0
                rng = self.headers.get("Range")
                if rng and server.mode != "no_range":
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(data):
                        self.send_error(416, "Range Not Satisfiable")
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                drop = server.mode == "drop_always" or (
                    server.mode == "drop_once" and len(server.requests) == 1
                )
                if drop:
                    self.wfile.write(body[: max(1, len(body) // 2)])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

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


def ptb_archive(tmp_path: Path) -> bytes:
    src = make_ptb(tmp_path / "ptb-src")
    return tgz_bytes(
        {f"./simple-examples/data/{p.name}": p.read_bytes() for p in sorted(src.iterdir())}
        | {"./simple-examples/README": b"generated"}
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_in(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.exists() else set()


def test_good_archive_gives_a_prepared_corpus(tmp_path, server):
    archive = ptb_archive(tmp_path)
    server.files["/simple-examples.tgz"] = archive
    dest = tmp_path / "ptb"
    out = download("ptb", dest, url=server.url("/simple-examples.tgz"), sha256=sha(archive), backoff=0)
    assert out == dest.absolute()
    assert files_in(dest) == {f"ptb.{s}.txt" for s in ("train", "valid", "test")} | {
        f"ptb.char.{s}.txt" for s in ("train", "valid", "test")
    }
    word = open_corpus(f"ptb-word:{dest}")
    char = open_corpus(f"ptb-char:{dest}")
    assert word.num_tokens("train") > 0 and char.vocab.size > 10
    # a second run finds the files and does not fetch again
    n = len(server.requests)
    download("ptb", dest, url=server.url("/simple-examples.tgz"), sha256=sha(archive))
    assert len(server.requests) == n


def test_cli_download_enwik8_zip_and_keep_archive(tmp_path, server, capsys):
    data = enwik8_bytes(20_000)
    archive = zip_bytes({"enwik8": data})
    server.files["/enwik8.zip"] = archive
    dest = tmp_path / "e8"
    code = main(
        [
            "data",
            "download",
            "enwik8",
            "--dest",
            str(dest),
            "--url",
            server.url("/enwik8.zip"),
            "--sha256",
            sha(archive),
            "--keep-archive",
        ]
    )
    assert code == 0
    assert files_in(dest) == {"enwik8", "enwik8.zip"}
    assert (dest / "enwik8").read_bytes() == data
    assert "specs: enwik8:" in capsys.readouterr().err
    assert (
        open_corpus(f"enwik8:{dest}").vocab.decode_bytes(open_corpus(f"enwik8:{dest}").split("train"))[:50]
        == data[:50]
    )


def test_corrupted_archive_is_a_checksum_error_and_leaves_nothing(tmp_path, server):
    archive = zip_bytes(
        {
            "wikitext-2/wiki.train.tokens": b"a b\n" * 500,
            "wikitext-2/wiki.valid.tokens": b"a\n",
            "wikitext-2/wiki.test.tokens": b"b\n",
        }
    )
    server.files["/wikitext-2-v1.zip"] = archive
    server.mode = "corrupt"
    dest = tmp_path / "wt2"
    with pytest.raises(
        DataError, match=f"checksum mismatch for wikitext-2-v1.zip: expected sha256 {sha(archive)}"
    ):
        download("wikitext2", dest, url=server.url("/wikitext-2-v1.zip"), sha256=sha(archive), backoff=0)
    assert files_in(dest) == set()  # no .part, no archive, no extracted file


def test_pinned_member_checksums_are_enforced_without_override(tmp_path, server, monkeypatch):
    archive = ptb_archive(tmp_path)  # generated files: they cannot match the real PTB pins
    server.files["/simple-examples.tgz"] = archive
    dest = tmp_path / "ptb"
    with pytest.raises(DataError, match="checksum mismatch for simple-examples.tgz: expected md5"):
        download("ptb", dest, url=server.url("/simple-examples.tgz"), backoff=0)
    assert files_in(dest) == set()
    # past the archive pin (as if this were the published archive), each file's own pin still holds
    monkeypatch.setitem(SOURCES, "ptb", dataclasses.replace(SOURCES["ptb"], md5=hashlib.md5(archive).hexdigest()))
    with pytest.raises(DataError, match="simple-examples/data/ptb.train.txt"):
        download("ptb", dest, url=server.url("/simple-examples.tgz"), backoff=0)
    assert files_in(dest) == set()


def test_dropped_connection_is_resumed_with_range(tmp_path, server):
    archive = ptb_archive(tmp_path)
    server.files["/a.tgz"] = archive
    server.mode = "drop_once"
    dest = tmp_path / "ptb"
    download("ptb", dest, url=server.url("/a.tgz"), sha256=sha(archive), backoff=0)
    assert server.requests[0]["range"] is None
    assert server.requests[1]["range"] == f"bytes={len(archive) // 2}-"
    assert "ptb.train.txt" in files_in(dest) and not any(n.endswith(".part") for n in files_in(dest))


def test_server_that_keeps_dropping_gives_a_clean_error_then_a_rerun_resumes(tmp_path, server):
    archive = ptb_archive(tmp_path)
    server.files["/a.tgz"] = archive
    server.mode = "drop_always"
    dest = tmp_path / "ptb"
    with pytest.raises(DataError, match=r"interrupted after .* run the same command again to resume") as err:
        download("ptb", dest, url=server.url("/a.tgz"), sha256=sha(archive), retries=2, backoff=0)
    assert "\n" not in str(err.value)
    assert files_in(dest) == {"simple-examples.tgz.part"}  # partial, and named so
    have = (dest / "simple-examples.tgz.part").stat().st_size
    assert 0 < have < len(archive)
    server.mode = "ok"
    download("ptb", dest, url=server.url("/a.tgz"), sha256=sha(archive), backoff=0)
    assert server.requests[-1]["range"] == f"bytes={have}-"
    assert "ptb.char.test.txt" in files_in(dest)


def test_server_without_range_support_restarts_cleanly(tmp_path, server):
    archive = ptb_archive(tmp_path)
    server.files["/a.tgz"] = archive
    dest = tmp_path / "ptb"
    dest.mkdir()
    (dest / "simple-examples.tgz.part").write_bytes(archive[:1000])
    server.mode = "no_range"
    download("ptb", dest, url=server.url("/a.tgz"), sha256=sha(archive), backoff=0)
    assert (dest / "ptb.train.txt").is_file()


def test_http_error_and_bad_arguments(tmp_path, server):
    with pytest.raises(DataError, match="HTTP 404"):
        download("text8", tmp_path / "t8", url=server.url("/missing.zip"), backoff=0)
    with pytest.raises(DataError, match="no download for 'lm1b'; downloadable: enwik8, text8"):
        download("lm1b", tmp_path / "x")
    with pytest.raises(DataError, match="not a 64-digit hex"):
        download("text8", tmp_path / "t8", url=server.url("/x"), sha256="abc")


def test_garbage_archive_with_matching_checksum_is_reported_corrupt(tmp_path, server):
    junk = b"this is not a zip file" * 10
    server.files["/text8.zip"] = junk
    dest = tmp_path / "t8"
    with pytest.raises(DataError, match="text8.zip is corrupt"):
        download("text8", dest, url=server.url("/text8.zip"), sha256=sha(junk), backoff=0)
    assert files_in(dest) == set()


def test_every_source_has_urls_and_well_formed_pins():
    for src in SOURCES.values():
        assert src.urls and all(u.startswith(("http://", "https://")) for u in src.urls)
        for pin in [src.sha256, *(m.sha256 for m in src.members)]:
            assert pin is None or (len(pin) == 64 and int(pin, 16) >= 0)
