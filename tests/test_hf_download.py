"""`txl import-hf REPO_ID OUT`: files fetched with huggingface_hub from a local server on 127.0.0.1 that
serves the hub's URL layout (`/{repo}/resolve/{revision}/{file}`, HEAD for metadata then GET), pinned
to the known revision of transfo-xl/transfo-xl-wt103 unless --revision says otherwise."""

from __future__ import annotations

import hashlib
import http.server
import re
import socket
import threading
from pathlib import Path

import pytest

import hf_fixtures as F
from txl.cli.main import main
from txl.data import Vocab
from txl.models.hf_import import KNOWN_REVISIONS

pytest.importorskip("huggingface_hub", reason="download by repo id needs huggingface_hub (hf extra)")
pytest.importorskip("transformers", reason="builds the served checkpoint with transformers==4.35.2 (dev extra)")
pytest.importorskip("sacremoses", reason="the imported vocabulary tokenises with sacremoses (hf extra)")
pytestmark = pytest.mark.hf

REPO = "transfo-xl/transfo-xl-wt103"
PINNED = KNOWN_REVISIONS[REPO]
OTHER = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """repos[repo][commit] = {filename: bytes}; 'main' resolves to `main[repo]`. Records every request."""

    def __init__(self):
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self.main: dict[str, str] = {}
        self.requests: list[tuple[str, str, str, str]] = []  # (method, repo, revision, file)
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body: bool):
                found = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
                if not found:
                    return self.fail(404, "RepoNotFound")
                repo, revision, filename = found.groups()
                hub.requests.append((self.command, repo, revision, filename))
                if repo not in hub.repos:
                    return self.fail(404, "RepoNotFound")
                commit = hub.main.get(repo) if revision == "main" else revision
                if commit not in hub.repos[repo]:
                    return self.fail(404, "RevisionNotFound")
                files = hub.repos[repo][commit]
                if filename not in files:  # the hub names the commit it looked in (clients cache the absence)
                    return self.fail(404, "EntryNotFound", commit)
                data = files[filename]
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def fail(self, status: int, code: str, commit: str | None = None):
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _repo_files(tmp: Path, weights: str = "model.safetensors") -> tuple[dict[str, bytes], object]:
    tok = F.build_tokenizer()
    src = tmp / "hf-src"
    src.mkdir(parents=True)
    tok.save_vocabulary(str(src))
    F.save_hf_model(src, len(tok.idx2sym))
    if weights == "pytorch_model.bin":  # what the 2019 repositories hold
        import torch
        from safetensors.torch import load_file

        torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.name in ("config.json", weights, "vocab.pkl")}
    return files, tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    hub = Hub()
    pinned_files, tok = _repo_files(tmp / "a")
    other_files, _ = _repo_files(tmp / "b", weights="pytorch_model.bin")
    hub.repos[REPO] = {PINNED: pinned_files, OTHER: other_files}
    hub.main[REPO] = OTHER  # the branch has moved on: only the pin gives the known files
    yield hub, tok
    hub.close()


@pytest.fixture
def hub_env(served, tmp_path, monkeypatch):
    hub, tok = served
    hub.requests.clear()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hub, tok


def test_repo_id_downloads_the_pinned_revision_and_imports(hub_env, tmp_path, capsys):
    hub, tok = hub_env
    out = tmp_path / "wt103"
    assert main(["import-hf", REPO, str(out)]) == 0
    assert "vocab.json" in capsys.readouterr().out
    fetched = {(rev, name) for method, _repo, rev, name in hub.requests if method == "GET"}
    assert fetched == {(PINNED, "config.json"), (PINNED, "model.safetensors"), (PINNED, "vocab.pkl")}
    assert {rev for _m, _r, rev, _n in hub.requests} == {PINNED}
    vocab = Vocab.load(out / "vocab.json")
    sentence = "The year 1990 was 23,000 people's state-of-the-art time."
    assert vocab.encode(sentence).tolist() == tok.encode(sentence)
    # the result is what `txl generate` uses directly
    assert main(["generate", str(out), "--prompt", "The year", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("The year")


def test_revision_flag_and_a_repository_with_only_pytorch_model_bin(hub_env, tmp_path):
    hub, _tok = hub_env
    assert main(["import-hf", REPO, str(tmp_path / "out"), "--revision", OTHER]) == 0
    fetched = {(rev, name) for method, _repo, rev, name in hub.requests if method == "GET"}
    assert fetched == {(OTHER, "config.json"), (OTHER, "pytorch_model.bin"), (OTHER, "vocab.pkl")}
    assert (tmp_path / "out" / "vocab.json").is_file()


def test_the_legacy_name_means_the_same_repository(hub_env, tmp_path):
    hub, _tok = hub_env
    assert main(["import-hf", "transfo-xl-wt103", str(tmp_path / "out")]) == 0
    assert {(repo, rev) for _m, repo, rev, _n in hub.requests} == {(REPO, PINNED)}


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ([REPO, "--revision", "f" * 40], "no such revision"),
        (["someone/not-there"], "no such repository"),
    ],
)
def test_download_failures_are_one_line(hub_env, tmp_path, capsys, args, why):
    out = tmp_path / "out"
    assert main(["import-hf", args[0], str(out), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert not out.exists()


def test_without_network_the_command_fails_with_one_line(tmp_path, monkeypatch, capfd):
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    import huggingface_hub.utils._http as hub_http

    monkeypatch.setattr(hub_http.time, "sleep", lambda _seconds: None)  # its 5 retries wait 23 s in all
    out = tmp_path / "out"
    assert main(["import-hf", REPO, str(out)]) == 2
    err = capfd.readouterr().err  # file-descriptor level: huggingface_hub's own log handler writes there too
    assert "unreachable" in err and PINNED in err and err.count("\n") == 1, err
    assert not out.exists()


def test_revision_with_a_local_directory_is_a_usage_mistake(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--revision", "main"]) == 2
    assert "applies to a hub repo id" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["absolute", "wt103-hf", "./rel/dir", "dir/"])
def test_a_path_that_is_no_directory_is_not_sent_to_the_hub(hub_env, tmp_path, capsys, name):
    hub, _tok = hub_env
    src = str(tmp_path / "missing" / "dir") if name == "absolute" else name
    assert main(["import-hf", src, str(tmp_path / "out")]) == 2
    assert "directory not found" in capsys.readouterr().err
    assert hub.requests == []


def test_a_second_import_works_offline_from_the_cache(hub_env, tmp_path, monkeypatch):
    """The pinned revision is a commit: once its files are cached, no request is needed."""
    hub, _tok = hub_env
    assert main(["import-hf", REPO, str(tmp_path / "first"), "--revision", OTHER]) == 0  # the .bin-only commit
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    import huggingface_hub.utils._http as hub_http

    monkeypatch.setattr(hub_http.time, "sleep", lambda _seconds: None)
    hub.requests.clear()
    assert main(["import-hf", REPO, str(tmp_path / "again"), "--revision", OTHER]) == 0
    assert (tmp_path / "again" / "vocab.json").read_bytes() == (tmp_path / "first" / "vocab.json").read_bytes()


def test_without_huggingface_hub_a_repo_id_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    assert main(["import-hf", REPO, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'txl[hf]'" in err and err.count("\n") == 1, err


def test_a_repository_whose_tokenizer_added_a_token_imports_with_its_added_tokens_json(hub_env, tmp_path):
    """added_tokens.json is fetched with the rest (here it alone names `<formula>`: a tokenizer_config.json
    without added_tokens_decoder, as transformers < 4.34 wrote it)."""
    import json

    hub, _tok = hub_env
    folder = Path(__file__).parent / "data" / "hf_added_tokens"
    files = {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors", "vocab.pkl",
                                                            "added_tokens.json")}
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["added_tokens_decoder"]
    files["tokenizer_config.json"] = json.dumps(config).encode()
    hub.repos["someone/added"] = {OTHER: files}
    hub.main["someone/added"] = OTHER
    assert main(["import-hf", "someone/added", str(tmp_path / "out")]) == 0
    assert ("GET", "someone/added", "main", "added_tokens.json") in hub.requests
    vocab = Vocab.load(tmp_path / "out" / "vocab.json")
    expected = json.loads((folder / "expected.json").read_text(encoding="utf-8"))["ids"]
    assert vocab.size == 68 and all(vocab.encode(s).tolist() == ids for s, ids in expected.items())
