"""`txl import-hf SRC OUT`: convert a Hugging Face TransfoXL checkpoint (a directory, or a hub repo id)
with its vocab.pkl, read without unpickling, into a txl checkpoint directory. The conversion is
`txl.models.hf_import.import_hf`."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    from txl.models.hf_import import KNOWN_REVISIONS

    parser.add_argument("src", help="HF TransfoXL directory (config.json + model.safetensors or pytorch_model.bin "
                                    "[+ vocab.pkl]) or a hub repo id, e.g. transfo-xl/transfo-xl-wt103")
    parser.add_argument("out", help="output txl checkpoint directory (config.json + model.safetensors + vocab.json)")
    parser.add_argument("--revision", help="hub revision (commit, branch or tag) of a repo id; default: the known "
                                           "commit of transfo-xl/transfo-xl-wt103 "
                                           f"({KNOWN_REVISIONS['transfo-xl/transfo-xl-wt103'][:12]}), main for others")


def run(args: argparse.Namespace) -> int:
    from txl.models.hf_import import import_hf

    config = import_hf(args.src, args.out, revision=args.revision)
    has_vocab = (Path(args.out) / "vocab.json").is_file()
    print(
        f"wrote {args.out}: {config.n_layer} layers, d_model {config.d_model}, vocab {config.vocab_size}, "
        f"cutoffs {list(config.cutoffs)}, div_val {config.div_val}"
        + (", vocab.json with WikiText-103 tokenisation" if has_vocab else "")
    )
    return 0
