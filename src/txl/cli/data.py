"""`txl data list | download | prepare | stats`: the command-line face of the data layer.

Imported by `txl.cli.main` to build the parser, so it must stay light: no torch here (numpy is fine).
"""

from __future__ import annotations

import argparse
import json
import sys

from txl.errors import DataError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the `txl data` actions to `parser`."""
    parser.set_defaults(_data_parser=parser)
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")

    p = sub.add_parser("list", help="known corpora and downloads", description="List the known corpus specs.")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "download",
        help="fetch a benchmark archive (resumable, sha256-checked) and extract it",
        description="Download NAME (enwik8, text8, wikitext103, wikitext2, ptb), verify its sha256, "
        "extract the files the readers need into DEST.",
    )
    p.add_argument("name", help="enwik8 | text8 | wikitext103 | wikitext2 | ptb")
    p.add_argument("--dest", help="directory to fill (default: $TXL_CACHE_DIR/downloads/NAME)")
    p.add_argument("--url", help="download from this URL instead of the canonical mirrors")
    p.add_argument("--sha256", help="expect this archive sha256 instead of the pinned one")
    p.add_argument("--retries", type=int, default=3, help="resume attempts after a dropped connection")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without data before retrying")
    p.add_argument("--max-bytes", type=int, help="stop (and delete) a download larger than this (default: the "
                                                 "corpus's own limit, a little above its published size)")
    p.add_argument("--deadline", type=float, default=6 * 3600.0, help="seconds for the whole download (default 6 h)")
    p.add_argument("--min-rate", type=float, default=1024.0,
                   help="abandon a transfer slower than this many bytes/s over a minute (default 1024)")
    p.add_argument("--keep-archive", action="store_true", help="keep the verified archive next to the files")
    p.add_argument("--force", action="store_true", help="download again even if the files are present")

    for action, help_text in (
        ("prepare", "tokenize a corpus once into the cache (memory-mapped .npy + vocab.json + meta.json)"),
        ("stats", "token counts per split and vocabulary size"),
    ):
        p = sub.add_parser(action, help=help_text, description=help_text)
        p.add_argument(
            "spec", help="NAME[:PATH][?key=value&...], e.g. ptb-word:data/ptb (see `txl data list`)"
        )
        p.add_argument("--cache-dir", help="cache root (default: $TXL_CACHE_DIR or ~/.cache/txl)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument(
            "--vocab-size",
            type=int,
            metavar="N",
            help="fail unless the vocabulary has N ids (e.g. a checkpoint's vocab_size)",
        )
        p.add_argument("--vocab", metavar="FILE", help="fail unless the vocabulary equals this vocab.json")
        if action == "prepare":
            p.add_argument("--force", action="store_true", help="prepare again even if the cache is valid")
            p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "data_command", None)
    if action is None:
        args._data_parser.print_help()
        return 0
    if action == "list":
        return _list(args)
    if action == "download":
        from txl.data.fetch import download

        if args.retries < 0:
            raise DataError(f"--retries must be >= 0, got {args.retries}")
        if not 0 < args.timeout < float("inf"):
            raise DataError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
        download(
            args.name,
            args.dest,
            url=args.url,
            sha256=args.sha256,
            retries=args.retries,
            timeout=args.timeout,
            keep_archive=args.keep_archive,
            force=args.force,
            log=_log,
            max_bytes=args.max_bytes,
            deadline=args.deadline,
            min_rate=args.min_rate,
        )
        return 0
    from txl.data.spec import SEQ2SEQ_CORPORA, parse_spec

    if parse_spec(args.spec).name in SEQ2SEQ_CORPORA:  # pair corpora (txl.models.seq2seq)
        return _pairs(args, action)
    from txl.data.corpus import open_corpus

    quiet = getattr(args, "quiet", False) or action == "stats" and args.json
    corpus = open_corpus(
        args.spec, args.cache_dir, force=getattr(args, "force", False), log=None if quiet else _log
    )
    if args.vocab_size is not None:
        corpus.vocab.check_matches(args.vocab_size)
    if args.vocab is not None:
        from txl.data.vocab import Vocab

        corpus.vocab.check_same(Vocab.load(args.vocab, follow_links=True), what=args.vocab)
    stats = corpus.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(format_stats(stats))
    return 0


def _pairs(args: argparse.Namespace, action: str) -> int:
    """prepare / stats of a pair corpus: pairs per split, what the length limits dropped, vocabularies."""
    from txl.data.seq2seq import open_pair_corpus
    from txl.data.spec import parse_spec

    spec = parse_spec(args.spec)
    if spec.name == "pydoc-summaries":
        from txl.data.pydoc import prepare

        path, _ = prepare(force=getattr(args, "force", False))
        if not (getattr(args, "quiet", False) or args.json):
            _log(f"pydoc-summaries: pairs cached in {path}")
    corpus = open_pair_corpus(spec)
    vocab = corpus.vocab
    stats = {"spec": corpus.spec, "name": corpus.name, "pairs": {s: len(corpus.ids[s]) for s in corpus.splits},
             "dropped_by_length": corpus.dropped, "vocabulary": vocab.kind, "shared_vocabulary": vocab.shared,
             "source_vocab_size": vocab.source.size, "target_vocab_size": vocab.target.size,
             "vocab_fingerprint": vocab.fingerprint}
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print("\n".join(f"{k:18} {v}" for k, v in stats.items()))
    return 0


def format_stats(stats: dict) -> str:
    """A readable table of `Corpus.stats()`."""
    rows = [
        ("corpus", f"{stats['name']}  ({stats['spec']})"),
        ("metric", stats["metric"]),
        ("vocab", f"{stats['vocab_size']:,}  ({stats['dtype']})"),
    ]
    rows += [(split, f"{n:>14,} tokens") for split, n in stats["tokens"].items()]
    for split, n in stats.get("sentences", {}).items():
        rows.append((f"{split} sentences", f"{n:>14,}"))
    rows += [("fingerprint", stats["fingerprint"][:16]), ("cache", stats["cache"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _list(args: argparse.Namespace) -> int:
    from txl.data.fetch import SOURCES
    from txl.data.spec import KNOWN

    if args.json:
        print(
            json.dumps(
                {
                    n: {
                        "description": i.description,
                        "metric": i.metric,
                        "download": i.download,
                        "options": list(i.options),
                    }
                    for n, i in KNOWN.items()
                },
                indent=2,
            )
        )
        return 0
    width = max(map(len, KNOWN))
    print("corpora (spec NAME[:PATH][?key=value&...]):")
    for name, info in KNOWN.items():
        opts = f"  options: {', '.join(info.options)}" if info.options else ""
        print(f"  {name:<{width}}  {info.description}{opts}")
    print(f"downloads (txl data download NAME --dest DIR): {', '.join(SOURCES)}")
    return 0
