"""Small generated corpora in each real layout, for the data tests (a plain module, not conftest.py,
so its name cannot clash with another conftest on sys.path).

Nothing here copies real corpus text: the generators build random words from a fixed seed, in the
file layouts the readers expect (PTB, WikiText, enwik8, text8, lm1b, plain text).
"""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np

# The real corpora (PTB, an enwiki excerpt) for the tests that read them, skipped where absent:
# TXL_SHARED_DATA=DIR, else a shared/data folder beside the checkout. No machine's path is written here.
SHARED = Path(os.environ.get("TXL_SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")


def random_words(rng: np.random.Generator, n_types: int = 60) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=int(rng.integers(1, 8)))) for _ in range(n_types)]


def word_lines(seed: int, n_lines: int, vocab: list[str] | None = None, unk: bool = True) -> list[str]:
    """Lines of Zipf-ish random words, some with <unk> and N like PTB, some empty like WikiText."""
    rng = np.random.default_rng(seed)
    words = vocab or random_words(rng)
    if unk:
        words = [*words, "<unk>", "N"]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    lines = []
    for _ in range(n_lines):
        k = int(rng.integers(0, 12))
        lines.append(" ".join(rng.choice(words, size=k, p=p)))
    return lines


def normalized(text: str) -> str:
    """What a words reader decodes to: single spaces, one '\\n' per line (an unterminated last line
    gets one too, as the reference's eos)."""
    lines = text.split("\n")
    tail = lines.pop()
    out = "".join(" ".join(line.split()) + "\n" for line in lines)
    if tail:
        out += " ".join(tail.split()) + "\n"
    return out


def make_ptb(root: Path, seed: int = 0, n_lines=(300, 40, 40)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = random_words(rng)
    for split, n, s in zip(("train", "valid", "test"), n_lines, (1, 2, 3)):
        lines = word_lines(seed * 10 + s, n, vocab)
        # PTB style: a leading and a trailing space on every line
        (root / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in lines))
        chars = [" ".join("_".join(line.split())) for line in lines]
        (root / f"ptb.char.{split}.txt").write_text("".join(f"{c}\n" for c in chars))
    return root


def make_wikitext(root: Path, sub: str = "wikitext-103", seed: int = 5) -> Path:
    d = root / sub
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = [w.capitalize() if i % 3 == 0 else w for i, w in enumerate(random_words(rng))]
    for split, n, s in zip(("train", "valid", "test"), (200, 30, 30), (1, 2, 3)):
        lines = word_lines(seed * 10 + s, n, vocab)
        lines.insert(0, "")
        lines.insert(1, " = Heading = ")
        (d / f"wiki.{split}.tokens").write_text("".join(f" {line} \n" for line in lines))
    return root


def enwik8_bytes(n: int = 40_000, seed: int = 7) -> bytes:
    """XML-ish bytes that contain every byte value 0..255 (enwik8 itself has invalid UTF-8 too)."""
    rng = np.random.default_rng(seed)
    body = bytearray()
    while len(body) < n:
        body += b"<page>\n  <title>" + bytes(rng.integers(97, 123, size=8, dtype=np.uint8)) + b"</title>\n"
        body += "  <text>Caf\u00e9 \u2014 na\u00efve \u65e5\u672c</text>\n</page>\n".encode()
        body += bytes(rng.integers(0, 256, size=64, dtype=np.uint8))
    body[:256] = bytes(range(256))
    return bytes(body[:n])


def make_lm1b(root: Path, seed: int = 11, shards: int = 3, vocab_file: bool = False) -> Path:
    base = root / "1-billion-word-language-modeling-benchmark-r13output"
    train = base / "training-monolingual.tokenized.shuffled"
    held = base / "heldout-monolingual.tokenized.shuffled"
    train.mkdir(parents=True)
    held.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    vocab = random_words(rng, 40)
    for k in range(1, shards + 1):
        lines = [line or "x" for line in word_lines(seed + k, 60, vocab, unk=False)]
        (train / f"news.en-{k:05d}-of-00100").write_text("".join(line + "\n" for line in lines))
    lines = [line or "x" for line in word_lines(seed + 99, 40, [*vocab, "rareword"], unk=False)]
    (held / "news.en.heldout-00000-of-00050").write_text("".join(line + "\n" for line in lines))
    if vocab_file:
        syms = ["<S>", "</S>", "<UNK>", *sorted(set(vocab) | {"x"})]
        (root / "1b_word_vocab.txt").write_text("".join(f"{s}\t{i}\n" for i, s in enumerate(syms)))
    return root


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def tgz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
