"""Time incremental detokenisation (`txl.generate.text.TextStream`) for n generated words: it must grow
linearly in n (issue 16: re-decoding everything each step cost 24 s for 32k words).

    python scripts/decode_timing.py [--data ptb-word:DIR] [--tokens 4000,16000,32000]

Without --data, a synthetic 10,000-word vocabulary stands in for PTB's. The ids are random words with
an <eos> about every 20 tokens (no model is run: this times decoding alone). `--quadratic` also times
the old way (re-decoding the whole continuation each step) for comparison.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from txl.data import Vocab, open_corpus
from txl.generate.text import TextStream


def old_way(vocab, prefix, ids) -> float:
    start = time.perf_counter()
    shown, seen = len(vocab.decode(prefix)), []
    for token in ids:
        seen.append(token)
        text = vocab.decode(prefix + seen)
        shown = max(shown, len(text))
    return time.perf_counter() - start


def new_way(vocab, prefix, ids) -> float:
    pieces: list[str] = []
    start = time.perf_counter()
    stream = TextStream(vocab, pieces.append, prefix=prefix)
    for token in ids:
        stream.push(token)
    stream.close()
    elapsed = time.perf_counter() - start
    assert "".join(pieces) == vocab.decode(prefix + ids)[len(vocab.decode(prefix)):]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a word-level data spec whose vocabulary to use (default: synthetic 10k)")
    parser.add_argument("--tokens", default="4000,16000,32000", help="comma-separated token counts")
    parser.add_argument("--quadratic", action="store_true", help="also time re-decoding everything each step")
    args = parser.parse_args()
    if args.data:
        vocab = open_corpus(args.data).vocab
    else:
        vocab = Vocab("words", ["<eos>", "<unk>", *[f"w{i}" for i in range(9998)]], eos="<eos>", unk="<unk>")
    rng = np.random.default_rng(0)
    print(f"vocabulary: {vocab.kind}, {vocab.size:,} ids")
    print("| tokens | incremental (s) | µs/token |" + (" re-decode all (s) |" if args.quadratic else ""))
    print("|---|---|---|" + ("---|" if args.quadratic else ""))
    for n in (int(t) for t in args.tokens.split(",")):
        ids = rng.integers(2, vocab.size, n)
        ids[rng.random(n) < 0.05] = vocab.eos_id
        ids = [int(i) for i in ids]
        prefix = ids[:8]
        seconds = min(new_way(vocab, prefix, ids) for _ in range(3))
        row = f"| {n:,} | {seconds:.3f} | {seconds / n * 1e6:.1f} |"
        if args.quadratic:
            row += f" {old_way(vocab, prefix, ids):.1f} |"
        print(row)


if __name__ == "__main__":
    main()
