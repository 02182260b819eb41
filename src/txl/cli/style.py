"""`txl generate RUN --style S`: rewrite sentences in style S with a Style Transformer run
(arch = style-transformer, `txl.models.style`); `txl eval RUN`: score its transfers (`run_eval`).

The sentences are `--prompt TEXT`, one per line of `--prompt-file FILE`, or one per line of `--input FILE`;
each is tokenised as the run's corpus (`txl.data.style.tokenize`: lower case, words and punctuation, unknown
words read as <unk>) and transferred greedily, as the paper evaluates; one output per line (`--json`: the
sources, the outputs and the style)."""

from __future__ import annotations

import argparse
import json
import sys

from txl.errors import UsageError


def _sentences(args: argparse.Namespace, read_prompts) -> list[str]:
    if args.input:
        if args.prompt is not None or args.prompt_file:
            raise UsageError("give the sentences with one of --prompt, --prompt-file or --input")
        args.prompt_file, args.input = args.input, None
    if args.prompt is None and not args.prompt_file:
        raise UsageError("--style rewrites sentences: give one with --prompt TEXT, or one per line with --input FILE")
    sentences = read_prompts(args)
    if not any(s.strip() for s in sentences):
        raise UsageError("--prompt is empty: give a sentence to rewrite")
    return sentences


def run_transfer(args: argparse.Namespace, *, read_prompts) -> int:
    """`read_prompts`: txl.cli.generate's reader of --prompt / --prompt-file (passed in: this module is
    imported by that one)."""
    from txl.cli.arguments import resolve_device
    from txl.data.display import for_stream
    from txl.data.style import encode_sentence
    from txl.eval.style import transfer_sentences
    from txl.models.checkpoint import load_checkpoint

    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                      ("--top-p", args.top_p), ("--seed", args.seed), ("--mem-len", args.mem_len))
             if value is not None] + (["--num-samples"] if args.num_samples != 1 else [])
    if given:
        raise UsageError(f"--style transfers greedily, as the Style Transformer is evaluated; drop {given[0]}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sentences = _sentences(args, read_prompts)
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, require_vocab=True)
    config = ckpt.model.config
    if config.arch != "style-transformer":
        raise UsageError(f"{ckpt.path} is a {config.arch} model; --style needs a Style Transformer run "
                         "(txl train --preset style-transfer)")
    style = config.style_index(args.style)
    model, vocab = ckpt.model.eval(), ckpt.vocab
    steps = min(args.max_new_tokens, config.max_length)
    encoded = [encode_sentence(vocab, s) for s in sentences]
    outputs = [vocab.decode(ids) for ids in transfer_sentences(model, encoded, style, device=device, max_length=steps)]
    name = config.style_names[style] if config.style_names else str(style)
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt.path), "style": name, "transfers": [
            {"source": s, "transfer": t} for s, t in zip(sentences, outputs)]}, indent=2, ensure_ascii=False))
        return 0
    for text in outputs:
        sys.stdout.write(for_stream(text, sys.stdout) + "\n")
    sys.stdout.flush()
    return 0


def run_eval(args: argparse.Namespace, ckpt, device) -> int:
    """`txl eval RUN` of a Style Transformer run: every sentence of a split transferred into the other style,
    scored by the paper's three measures (`txl.eval.style`), with `--samples` transfers each way."""
    from txl.data.display import for_stream
    from txl.data.style import open_style_corpus
    from txl.eval.style import bleu_available, real_table, rows_table, score_style_transfer

    lm_only = [flag for flag, given in (
        ("--text", args.text), ("--vanilla", args.vanilla), ("--sweep-mem", args.sweep_mem),
        ("--per-token", args.per_token), ("--dynamic-lr", args.dynamic_lr is not None),
        ("--mask-prob", args.mask_prob is not None), ("--tgt-len", args.tgt_len is not None),
        ("--mem-len", args.mem_len is not None), ("--clamp-len", args.clamp_len is not None),
        ("--same-length", args.same_length is not None), ("--max-tokens", args.max_tokens),
        ("--max-pairs", args.max_pairs)) if given]
    if lm_only:
        raise UsageError(f"{lm_only[0]} does not apply to a Style Transformer run: it is scored on a split of its "
                         "style corpus (--split, --data, --max-sentences, --samples)")
    spec = args.data or ckpt.data_spec
    if spec is None:
        raise UsageError(f"{ckpt.path} records no corpus; name one with --data SPEC")
    corpus = open_style_corpus(spec, vocab=ckpt.vocab)
    config = ckpt.model.config
    names = tuple(config.style_names) or tuple(str(i) for i in range(config.n_styles))
    if len(corpus.styles) != config.n_styles or (config.style_names and corpus.styles != names):
        raise UsageError(f"{corpus.spec} gives the styles ({', '.join(corpus.styles)}) but the run learned "
                         f"({', '.join(names)}), in that order: list one file per style of the run, in its order "
                         "(?names= renames them)")
    split = args.split or ("valid" if "valid" in corpus.splits else corpus.splits[-1])
    if split not in corpus.splits:
        raise UsageError(f"the corpus has no split {split!r} holding sentences of every style "
                         f"(splits: {', '.join(corpus.splits)})")
    if "train" not in corpus.splits:
        raise UsageError(f"{corpus.spec} has no train sentences of every style: the style classifier and the "
                         "target-style language models learn from them")
    progress = not args.quiet and sys.stderr.isatty()
    scores = score_style_transfer(ckpt.model, ckpt.vocab, corpus, split, max_sentences=args.max_sentences,
                                  n_samples=args.samples, device=device, progress=progress)
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt.path), "data": corpus.spec, **scores}, indent=2,
                         ensure_ascii=False))
        return 0
    counts = ", ".join(f"{name} {v['sentences']:,}" for name, v in scores["real"].items())
    print(f"checkpoint  {ckpt.path}\ndata        {corpus.spec} ({split}: {counts} sentences)\n")
    print(rows_table(scores))
    print("\nthe measures on the split's own sentences (their own style):\n")
    print(real_table(scores))
    if not bleu_available():
        print("(self-BLEU needs the optional package sacrebleu: pip install 'txl[style]')")
    directions = dict.fromkeys((s["from"], s["to"]) for s in scores["samples"])
    for source, target in directions:
        print(f"\nsamples, {source} -> {target}:\n\n| input | transfer |\n|---|---|")
        for s in scores["samples"]:
            if (s["from"], s["to"]) == (source, target):
                cells = [for_stream(s[k].replace("|", "\\|"), sys.stdout) for k in ("source", "transfer")]
                print(f"| {cells[0]} | {cells[1]} |")
    return 0
