"""Every command and Python snippet in README.md and docs/guide/*.md runs as pasted.

Each document's ```bash / ```sh / ```console commands and ```python blocks run in document order in one
sandbox (a fresh temporary directory per document, txl installed): a command through `bash -c`, a Python
block in a fresh interpreter; `bash -e`, so each command of `a ; b` must succeed. A command's comment is part of what a user pastes and is kept. The only
changes to what a user would paste:

(a) budget caps appended to every training command (CAPS, RESUME_CAPS): two optimiser steps, 2,000 scored
    tokens, a 20-token sample;
(b) offline data: a generated PTB-shaped folder in txl's download location (so `txl data download ptb`
    finds it already present) and wherever a command downloads it to; the placeholders of SUBSTITUTIONS
    (DIR, path/to/...) name generated folders; the Hugging Face commands reach a local hub on 127.0.0.1
    through HF_ENDPOINT (tests/test_hf_download.py's);
(c) run folders a document uses without making them first (MADE_RUNS) are trained first, with the caps;
(d) `txl serve`, which runs until it is stopped, gets a free `--port`: the test waits for /health, then
    stops it with SIGINT.

The user's own files the recipes name (notes.txt, letters.txt, ...) are written first (FILES). NOT_RUN
lists every snippet that cannot run here, with the reason; a test fails when that table and the snippets
left out differ, so a new snippet is never skipped silently.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guide").glob("*.md"))]
SHELL = ("bash", "sh", "console")
FENCE = re.compile(r"^```(\w*)\s*$")

# (a) appended to every `txl train` that starts a run, and to every `txl train --resume`
CAPS = "--set train.max_steps=2 --set train.eval_max_tokens=2000 --set train.final_max_tokens=2000 " \
       "--set train.sample_tokens=20"
RESUME_CAPS = "--max-steps 4"

# Snippets that do not run here, and why. Keyed by (document, the command as written, comment included).
NOT_RUN = {
    ("README.md", "pip install torch==2.13.0 && pip install -e . && txl train"):
        "installs packages (the test runs where they are installed); its demo, `txl train`, is tests/test_demo.py's",
    ("README.md", 'pip install -e ".[serve]"'): "installs packages",
    ("README.md", 'pip install -e ".[seq2seq]"                                  # ROUGE and BPE'): "installs packages",
    ("README.md", 'pip install -e ".[hf]"                                     # huggingface_hub + sacremoses'):
        "installs packages",
    ("README.md", 'pip install torch==2.13.0 && pip install -e ".[dev]" && pytest'):
        "installs packages, then runs the test suite this test is part of",
    ("README.md", "python experiments/arena.py                  # every variant on PTB-char, same size and CPU budget (hours)"):
        "a study of hours: 42 runs (tests/test_experiments.py runs it on a tiny budget)",
    ("README.md", "txl train --preset enwik8-base --data enwik8:DIR --set precision=bf16 --set compile=true"):
        "needs a GPU for bf16 + compile at this size, and enwik8",
    ("docs/guide/evaluation.md", "txl bench eval-speedup --attn-len 800,3800 --threads 1 --steps 3 --warmup 1   # rows 1-2"):
        "a benchmark of minutes (a vanilla forward at L = 3,800 takes 30-40 s); tests/test_bench.py runs it small",
    ("docs/guide/evaluation.md", "txl bench eval-speedup --attn-len 800,3800 --steps 3 --warmup 1               # rows 3-4"):
        "a benchmark of minutes",
    ("docs/guide/evaluation.md", "txl bench eval-speedup --attn-len 800,3800 --threads 1 --tgt-len 128 --steps 3 --warmup 1"):
        "a benchmark of minutes",
    ("docs/guide/evaluation.md", "python experiments/arena.py --variants xl,xl-mem0 --minutes 5          # or the two rows' commands in docs/results/arena.md"):
        "a study: two 5-minute runs",
    ("docs/guide/evaluation.md", 'txl recl runs/arena/xl-mem0 runs/arena/xl --names "mem_len 0,mem_len 128" --split valid \\\n'
                                 "    --contexts 100:800:100 --r 0.1,0.5,1.0 --mode window --positions 500 \\\n"
                                 "    --cache runs/recl-cache --out docs/results/recl_ptb_char"):
        "needs the study's two runs above; the recl command itself runs small in this page's RECL section",
    ("docs/guide/evaluation.md", 'pip install -e ".[serve]"                     # Starlette + uvicorn'): "installs packages",
    ("docs/guide/models.md", 'pip install -e ".[seq2seq]"                                # rouge-score + tokenizers'):
        "installs packages",
    ("docs/guide/models.md", 'pip install -e ".[hf]"                                    # huggingface_hub + sacremoses'):
        "installs packages",
    ("docs/guide/models.md", 'python experiments/claims.py --corpus "shakespeare=text:input.txt?tokenizer=chars" \\\n'
                             '    --corpus "enwiki=text:enwiki-2016-shortened.xml?tokenizer=bytes"   # ~2 h on 2 cores'):
        "a study of two hours on corpora not shipped (tests/test_claims.py runs it on a tiny budget)",
    ("docs/guide/training.md", "txl train --preset enwik8-base --data enwik8:/data/enwik8 --set precision=bf16 --set compile=true"):
        "needs a GPU for bf16 + compile at this size, and enwik8",
    ("docs/guide/training.md", "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\\n"
                               "         --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m txl train --preset wt103-large --data wikitext103:/data/wt103"):
        "two machines (the one-machine form, txl train --nproc 2, runs above)",
    ("docs/guide/training.md", "bash scripts/device_check.sh OUT"): "needs a GPU (tests/test_device_check.py checks the script)",
    ("docs/guide/training.md", "txl bench all"): "every benchmark: tens of minutes",
}

# (b) placeholders: a word of the command -> what it names here (keys of the sandbox's `paths`)
SUBSTITUTIONS = {
    r"(?<=ptb-char:)DIR\b": "ptb",
    r"(?<=ptb-word:)DIR\b": "ptb",
    r"path/to/wikitext-103": "wikitext-103",
    r"path/to/hf-dir": "hf-dir",
}

# (c) run folders a document may use before it makes them: data spec and settings of a tiny run
MICRO = "--set model.n_layer=2 --set model.d_model=32 --set model.n_head=2 --set model.d_head=16 --set model.d_inner=64"
MADE_RUNS = {
    "runs/notes": '--data "text:{notes}?tokenizer=chars"',
    "runs/small": '--data "text:{notes}?tokenizer=chars"',
    "runs/large": '--data "text:{notes}?tokenizer=chars"',
    "runs/demo": f"{MICRO}",
    "runs/ptb-char": f"--data ptb-char:{{ptb}} {MICRO} --set model.mem_len=32",
    "runs/ptb-char-mem0": f"--data ptb-char:{{ptb}} {MICRO} --set model.mem_len=0",
    "runs/ptbc": f"--data ptb-char:{{ptb}} {MICRO}",
    "runs/ptbw": f"--data ptb-word:{{ptb}} {MICRO}",
}


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    kind: str  # "shell" or "python"
    text: str


def snippets(doc: str) -> list[Snippet]:
    """The document's commands (a line, or lines joined by a trailing backslash) and Python blocks."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        i += 1
        if not fence or not fence.group(1):
            continue
        lang, start, body = fence.group(1), i, []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "python":
            out.append(Snippet(doc, start + 1, "python", "\n".join(body) + "\n"))
        elif lang in SHELL:
            command, first = [], 0
            for n, line in enumerate(body, start + 1):
                if lang == "console":
                    line = line[2:] if line.startswith("$ ") else ""  # output lines are not pasted
                if not command and (not line.strip() or line.lstrip().startswith("#")):
                    continue
                first = first or n
                command.append(line)
                if not line.endswith("\\"):
                    out.append(Snippet(doc, first, "shell", "\n".join(command)))
                    command, first = [], 0
    return out


ALL = [s for doc in DOCS for s in snippets(doc)]


def skipped(s: Snippet) -> bool:
    return s.kind == "shell" and (s.doc, s.text) in NOT_RUN


def test_the_table_of_snippets_not_run_is_exact():
    """Every entry of NOT_RUN is a snippet of the docs (none goes stale), and every snippet outside it runs."""
    commands = {(s.doc, s.text) for s in ALL if s.kind == "shell"}
    stale = sorted(set(NOT_RUN) - commands)
    assert not stale, f"NOT_RUN names commands no document has (any more): {stale}"
    assert all(reason.strip() for reason in NOT_RUN.values())
    assert {(s.doc, s.text) for s in ALL if skipped(s)} == set(NOT_RUN)


def test_the_snippets_are_found():
    """The extraction sees the README's set-up, a continued command, and the Python blocks."""
    readme = [s for s in ALL if s.doc == "README.md"]
    assert any(s.text.startswith("txl train ") and "\\\n" in s.text for s in readme)
    assert readme[0].text == "pip install torch==2.13.0 && pip install -e . && txl train"  # the two set-up
    assert readme[1].text == 'pip install torch==2.13.0 && pip install -e ".[dev]" && pytest'  # commands, as CI
    assert sum(s.kind == "python" for s in ALL) >= 8


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_link_of_the_docs_resolves():
    """Relative links of README.md, docs/guide and experiments/README.md name a file that exists and, with a
    #fragment into a markdown page, a heading of that page."""
    broken = []
    for doc in [*DOCS, "experiments/README.md"]:
        text = re.sub(r"```.*?```", "", (ROOT / doc).read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            path = ((ROOT / doc).parent / file).resolve() if file else ROOT / doc
            if not path.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
                broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------------------------------------- the sandbox


def _words(rng: random.Random, n: int) -> list[str]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "de", "pa", "qui", "zen", "bor", "tal"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def _prose(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    vocab = ["The", "the", "a", "and", "of", "to", "in", "is", "was", "letter", "notes", "day", "we", "said",
             "Dear", "friend", "garden", "morning", "long", "quiet", "river", "house", "wrote", "again"]
    out = []
    for _ in range(lines):
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 12))]
        out.append(" ".join(words) + rng.choice([".", ",", "!", "?", "."]))
    return "\n".join(out) + "\n"


def _write_ptb(folder: Path) -> None:
    """PTB's six files in their formats: words with <unk> and N, and the character files (`_` between words);
    more than 2,000 distinct words (ptb-word-small's adaptive-softmax cutoff)."""
    rng = random.Random(0)
    vocab = ["".join("abcdefghijklmnopqrstuvwxyz"[i // 26 ** k % 26] for k in range(3)) for i in range(3000)]
    vocab += ["<unk>", "N"]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2500), ("valid", 50), ("test", 50)):
        lines = [" " + " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 20))) + " " for _ in range(n)]
        (folder / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        chars = [" " + " _ ".join(" ".join(w) for w in line.split()) + " " for line in lines]
        (folder / f"ptb.char.{split}.txt").write_text("\n".join(chars) + "\n", encoding="utf-8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """What every sandbox shares: the generated corpora, the cache, the user's files, the made runs."""
    base = tmp_path_factory.mktemp("docs-world")
    paths = {"base": base, "cache": base / "cache", "ptb": base / "ptb", "notes": base / "files" / "notes.txt"}
    _write_ptb(paths["ptb"])
    _write_ptb(paths["cache"] / "downloads" / "ptb")  # `txl data download ptb`: already present
    training = (ROOT / "docs" / "guide" / "training.md").read_text(encoding="utf-8")
    files = {
        "notes.txt": _prose(1, 600),
        "letters.txt": _prose(2, 300),
        "new.txt": _prose(3, 60),
        "prompts.txt": "The \nDear \n",
        "my_folder/train.txt": _prose(4, 300),
        "pairs.tsv": "".join(f"{w} {v}\t{v} {w}\n" for w, v in zip(_words(random.Random(5), 400),
                                                                     _words(random.Random(6), 400))),
        "news.csv": "headlines,text\n" + "".join(f"{w},{w} {v} {w} {v}\n" for w, v in
                                                   zip(_words(random.Random(7), 400), _words(random.Random(8), 400))),
        "my.toml": re.search(r"```toml\n(.*?)```", training, re.S).group(1),
    }
    paths["files"] = files
    for name, text in files.items():
        (base / "files" / name).parent.mkdir(parents=True, exist_ok=True)
        (base / "files" / name).write_text(text, encoding="utf-8")
    paths["made"] = base / "made"
    yield paths
    if "hub" in paths:
        paths["hub"].close()


def _env(world, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(TXL_CACHE_DIR=str(world["cache"]), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1", COLUMNS="120")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def _made_run(world, name: str, sandbox: Path, env: dict) -> None:
    """(c) copy a tiny run trained once (with the caps) into the sandbox as `name`."""
    made = world["made"] / name.replace("/", "_")
    if not made.is_dir():
        args = MADE_RUNS[name].format(notes=world["notes"], ptb=world["ptb"])
        cmd = f"txl train {args} {CAPS} --out {made}"
        r = subprocess.run(["bash", "-c", cmd], cwd=world["base"], env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"making {name}: {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    shutil.copytree(made, sandbox / name)


def _strip_comment(command: str) -> tuple[str, str]:
    """Split `cmd   # comment` (a '#' after whitespace, outside quotes) into the command and the comment."""
    quote = None
    for i, c in enumerate(command):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip(), command[i:]
    return command, ""


def with_caps(command: str) -> str:
    """(a) the caps after every `txl train` of the command (before `&&`, `;`, `|` or `>`), comment kept."""
    body, comment = _strip_comment(command)
    parts = re.split(r"(\s*(?:&&|;|\||>)\s*)", body)
    for i, part in enumerate(parts):
        if re.match(r"\s*txl train\b", part):
            parts[i] = part.rstrip() + " " + (RESUME_CAPS if "--resume" in part else CAPS)
    return "".join(parts) + ("   " + comment if comment else "")


def substitute(command: str, world) -> str:
    for pattern, key in SUBSTITUTIONS.items():
        command = re.sub(pattern, str(world[key]) if key in world else key, command)
    return command


def _run_serve(command: str, sandbox: Path, env: dict) -> None:
    """(d) start the server on a free port, wait until /health answers, stop it with SIGINT."""
    port = _free_port()
    body, _ = _strip_comment(command)
    proc = subprocess.Popen(["bash", "-c", f"exec {body} --port {port}"], cwd=sandbox, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{command!r} exited {proc.returncode}: {proc.stdout.read()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    assert answer.status == 200
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"{command!r}: no /health answer within 300 s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _hub(world, tmp_path_factory) -> dict:
    """(b) a local Hugging Face hub with the pinned transfo-xl-wt103 revision, a local HF folder and a
    WikiText-103-shaped folder; the environment that sends huggingface_hub there."""
    pytest.importorskip("huggingface_hub", reason="the Hugging Face commands need the hf extra")
    pytest.importorskip("transformers", reason="the served checkpoint is built with transformers==4.35.2")
    pytest.importorskip("sacremoses", reason="the imported vocabulary tokenises with sacremoses")
    if "hub" not in world:
        import test_hf_download as H
        import test_hf_vocab as V

        hub = H.Hub()
        files, _ = H._repo_files(tmp_path_factory.mktemp("hub-files"))
        hub.repos[H.REPO] = {H.PINNED: files}
        hub.main[H.REPO] = H.PINNED
        hf_dir = world["base"] / "hf-dir"
        hf_dir.mkdir()
        for name, data in files.items():
            (hf_dir / name).write_bytes(data)
        wiki = world["base"] / "wikitext-103"
        wiki.mkdir()
        for split, repeat in (("train", 3), ("valid", 2), ("test", 4)):
            (wiki / f"wiki.{split}.tokens").write_text("\n".join(V.WIKI_LINES * repeat) + "\n", encoding="utf-8")
        world.update(hub=hub, **{"hf-dir": hf_dir, "wikitext-103": wiki})
    return {"HF_ENDPOINT": world["hub"].url, "HF_HOME": str(world["base"] / "hf-home")}


def _needs_hub(doc: str) -> bool:
    return any("import-hf" in s.text or "wt103-large" in s.text for s in ALL if s.doc == doc and not skipped(s))


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted({s.doc for s in ALL if not skipped(s)}, key=DOCS.index))
def test_every_snippet_of_the_document_runs(doc, world, tmp_path, tmp_path_factory):
    todo = [s for s in ALL if s.doc == doc and not skipped(s)]
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    for name in world["files"]:
        (sandbox / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(world["base"] / "files" / name, sandbox / name)
    shutil.copytree(world["ptb"], sandbox / "data" / "ptb")  # `txl data download ptb --dest data/ptb`
    env = _env(world, _hub(world, tmp_path_factory) if _needs_hub(doc) else None)
    for s in todo:
        for name in MADE_RUNS:  # (c) a run the command uses and no earlier command of the page made
            uses = re.search(rf"(?<![\w/-]){re.escape(name)}(?![\w-])", s.text)
            makes = re.search(rf"--out {re.escape(name)}(?![\w-])", s.text)
            if uses and not makes and not (sandbox / name).exists():
                _made_run(world, name, sandbox, env)
        where, started = f"{doc}:{s.line}", time.monotonic()
        if s.kind == "python":
            r = subprocess.run([sys.executable, "-c", s.text], cwd=sandbox, env=env, capture_output=True, text=True,
                               timeout=900)
            assert r.returncode == 0, f"{where}: the Python block failed\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            print(f"{time.monotonic() - started:6.1f} s  {where}: Python block")
            continue
        command = substitute(with_caps(s.text.replace("\\\n", " ")), world)
        if re.match(r"\s*txl serve\b", command):
            _run_serve(command, sandbox, env)
            print(f"{time.monotonic() - started:6.1f} s  {where}: {command}")
            continue
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=sandbox, env=env,
                           capture_output=True, text=True, timeout=900)  # -e: each command of `a ; b` must pass
        assert r.returncode == 0, (f"{where}: {command}\nexit {r.returncode}\n{r.stdout[-2000:]}\n"
                                   f"{r.stderr[-3000:]}")
        assert "Traceback" not in r.stderr, f"{where}: {command}\n{r.stderr[-3000:]}"
        print(f"{time.monotonic() - started:6.1f} s  {where}: {command}")
