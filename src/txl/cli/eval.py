"""`txl eval`: score a checkpoint on a split (bpc/ppl) with long memory, the vanilla baseline, a masked-LM
or dynamic evaluation, or a memory sweep. An encoder-decoder run is scored by `txl.cli.seq2seq`, a Style
Transformer run by `txl.cli.style`.

Kept free of torch at import time (`txl --help` imports every subcommand's `configure`); the work is
done by `txl.eval`, imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from txl.cli.arguments import (
    BEAM_SIZE,
    LENGTH_PENALTY,
    MAX_LENGTH,
    MAX_SCORED,
    PRECISIONS,
    add_checkpoint,
    add_threads,
    check_nonnegative,
    check_positive,
    integer,
    real,
    resolve_device,
    shown_number,
)
from txl.errors import OutputError, UsageError, describe_os_error
from txl.io import read_proc
from txl.io import write_text as write_file


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give comma-separated integers, e.g. 0,64,128,256") from None
    if not values:
        raise UsageError(f"{flag} needs at least one value")
    if any(v < 0 for v in values):
        raise UsageError(f"{flag} {text!r}: memory lengths must be >= 0")
    if max(values) > MAX_LENGTH:
        raise UsageError(f"{flag}: memory lengths must be <= {MAX_LENGTH:,}, got {shown_number(max(values))}")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    add_checkpoint(parser)
    parser.add_argument("--data", metavar="SPEC", help="data spec (default: the corpus the run trained on); "
                                                       "text:FILE with --split all scores FILE with the run's vocabulary")
    parser.add_argument("--split", default=None,
                        help="valid, test, train, or all (a whole text file: --data text:FILE); default valid, "
                             "else the split the corpus has (test, else train: a note says which)")
    parser.add_argument("--text", metavar="FILE",
                        help="score the whole of FILE with the checkpoint's vocab.json (bytes, chars, words, BPE); "
                             "same as --data text:FILE --split all")
    parser.add_argument("--tgt-len", type=int, help="segment length (default: the run's eval_tgt_len or tgt_len)")
    parser.add_argument("--mem-len", type=int, help="memory length per layer (default: the checkpoint's)")
    parser.add_argument("--clamp-len", type=int, help="relative distances beyond this share one position "
                                                      "vector (0 = no clamp; default: the checkpoint's)")
    parser.add_argument("--same-length", action=argparse.BooleanOptionalAction, default=None,
                        help="every query attends to exactly mem_len keys (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="parallel streams (vanilla: windows per forward, 0 = automatic); default 10 "
                             "(dynamic evaluation: 1, the only value it takes)")
    parser.add_argument("--warm-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="start each stream mem_len tokens early so every scored token has full context "
                             "(default: on)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16/fp16 autocast, or auto = bf16 where the device has fast bf16 (default fp32)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    add_threads(parser)
    parser.add_argument("--max-tokens", type=int, default=0, help="score only the first N targets (0 = all)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--per-token", metavar="FILE",
                        help="write each target's NLL (nats) in corpus order to FILE (.npy or .txt)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="report a NaN/Inf loss as a result (exit 0) instead of an error")
    mlm = parser.add_argument_group("masked LM (a bidirectional checkpoint, trained with --objective mlm)")
    mlm.add_argument("--mask-prob", type=real(0, 1, low_open=True, high_open=True),
                     help="share of positions masked (default: the run's mask_prob)")
    mlm.add_argument("--mask-seed", type=integer(0, 2**63 - 1), default=0, help="which positions are masked (default 0)")
    seq2seq = parser.add_argument_group("sequence-to-sequence runs (arch = encoder-decoder, rnn-seq2seq)")
    seq2seq.add_argument("--beam-size", type=BEAM_SIZE, default=4, help="beam search width next to greedy (default 4)")
    seq2seq.add_argument("--length-penalty", type=LENGTH_PENALTY, default=0.6,
                         help="GNMT alpha of beam search (default 0.6)")
    seq2seq.add_argument("--samples", type=integer(0, 100_000), default=10,
                         help="sample outputs printed next to references (a Style Transformer run: "
                              "transfers each way; default 10)")
    seq2seq.add_argument("--max-pairs", type=integer(0, MAX_SCORED), default=0,
                         help="score only the first N pairs (0 = all)")
    style = parser.add_argument_group("Style Transformer runs (arch = style-transformer): style accuracy, self-BLEU, "
                                      "target-style perplexity of the transfers, and --samples of them each way")
    style.add_argument("--max-sentences", type=integer(0, MAX_SCORED), default=0,
                       help="transfer only the first N sentences of each style (0 = all)")
    vanilla = parser.add_argument_group("vanilla baseline (Al-Rfou et al. 2018)")
    vanilla.add_argument("--vanilla", action="store_true",
                         help="score every token with a fresh window of --attn-len tokens and no memory")
    vanilla.add_argument("--attn-len", type=int, help="window length L (default: mem_len + tgt_len)")
    vanilla.add_argument("--stride", type=int, default=1,
                         help="score the last S positions of each window (default 1, the paper's figure)")
    dynamic = parser.add_argument_group("dynamic evaluation (Krause et al. 2018): keep learning from the scored text")
    dynamic.add_argument("--dynamic-lr", type=real(0), metavar="ETA",
                         help="after scoring each segment, one SGD step of size ETA on it (one stream; reported "
                              "as dynamic, apart from static scores)")
    dynamic.add_argument("--dynamic-decay", type=real(0, 1), default=0.0, metavar="LAMBDA",
                         help="pull the weights back toward the trained ones by LAMBDA per segment (default 0)")
    sweep = parser.add_argument_group("memory sweep")
    sweep.add_argument("--sweep-mem", metavar="M1,M2,...",
                       help="evaluate once per memory length; prints a markdown table, writes PREFIX.md, "
                            "PREFIX.png and PREFIX.json")
    sweep.add_argument("--sweep-out", metavar="PREFIX", default="eval_sweep",
                       help="output prefix of --sweep-mem (default: eval_sweep in the current directory)")


def run(args: argparse.Namespace) -> int:
    if args.dynamic_lr is not None:
        from txl.eval.dynamic import check_dynamic

        check_dynamic(args.dynamic_lr, args.dynamic_decay)
        if args.batch_size not in (None, 1):
            raise UsageError("dynamic evaluation reads one stream (--batch-size 1): with parallel streams the "
                             "weights would learn from text after what another stream scores next")
        if args.vanilla or args.sweep_mem:
            raise UsageError("--dynamic-lr does not combine with --vanilla or --sweep-mem")
        args.batch_size = 1
    elif args.dynamic_decay:
        raise UsageError("--dynamic-decay needs --dynamic-lr")
    if args.batch_size is None:
        args.batch_size = 10
    check_nonnegative(args, "mem_len", "clamp_len", "batch_size")
    check_nonnegative(args, "max_tokens", limit=MAX_SCORED)
    check_positive(args, "tgt_len", "attn_len", "stride")
    if not args.vanilla and args.batch_size == 0:
        raise UsageError("--batch-size must be >= 1 (0 = automatic applies to --vanilla only)")
    if args.sweep_mem and args.vanilla:
        raise UsageError("--sweep-mem sweeps Transformer-XL's memory; it does not combine with --vanilla")
    if args.per_token and Path(args.per_token).suffix not in (".npy", ".txt"):
        raise UsageError(f"--per-token {args.per_token}: use a .npy or .txt file name")
    if (args.attn_len is not None or args.stride != 1) and not args.vanilla:
        raise UsageError("--attn-len and --stride apply to the vanilla evaluator; add --vanilla")
    if args.text and args.data:
        raise UsageError("give --text FILE or --data SPEC, not both")
    if args.text and args.split not in (None, "valid", "all"):
        raise UsageError(f"--text scores the whole file; drop --split {args.split}")
    if args.text:
        try:
            Path(args.text).expanduser().is_dir()  # a name the system refuses (too long, a NUL) is one line
        except (OSError, ValueError) as err:
            why = describe_os_error(err) if isinstance(err, OSError) else "the name holds a NUL byte"
            raise UsageError(f"--text {args.text[:200]!r}: {why}") from None
    sweep = _int_list(args.sweep_mem, "--sweep-mem") if args.sweep_mem else None
    from txl.eval.api import evaluate_checkpoint
    from txl.eval.report import result_table, save_per_token
    from txl.models.checkpoint import load_checkpoint

    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device)
    if getattr(ckpt.model.config, "num_labels", 0):  # a document classifier (issue 47)
        return _run_classify(args, ckpt, device)
    if ckpt.model.config.arch == "style-transformer":  # the paper's three measures (txl.eval.style)
        from txl.cli.style import run_eval as run_style_eval

        return run_style_eval(args, ckpt, device)
    if args.split is None:
        args.split = "all" if args.text else _default_split(ckpt, args.data)
    _check_text_encoding(ckpt, args)
    from txl.models.registry import is_seq2seq

    if is_seq2seq(ckpt.model.config):  # the Transformer or the RNN encoder-decoder
        from txl.cli.seq2seq import run_eval as run_seq2seq_eval

        if args.dynamic_lr is not None:
            raise UsageError(f"{ckpt.path} is an encoder-decoder: dynamic evaluation applies to causal LMs")

        check_nonnegative(args, "samples", "max_pairs")
        check_positive(args, "beam_size")
        return run_seq2seq_eval(args, ckpt, device)
    progress = not args.quiet and sys.stderr.isatty()
    common = dict(data=args.data, split="all" if args.text else args.split, text=args.text, tgt_len=args.tgt_len, clamp_len=args.clamp_len,
                  same_length=args.same_length, batch_size=args.batch_size, warm_memory=args.warm_memory,
                  precision=args.precision, max_tokens=args.max_tokens, device=device, progress=progress)
    if sweep:
        return _run_sweep(args, ckpt, sweep, common)
    if args.mask_prob is not None and not 0 < args.mask_prob < 1:
        raise UsageError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if ckpt.model.config.causal and (args.mask_prob is not None or args.mask_seed):
        raise UsageError(f"--mask-prob and --mask-seed apply to masked-LM checkpoints; {ckpt.path} is a causal LM")
    result, nll = evaluate_checkpoint(ckpt, mem_len=args.mem_len, vanilla=args.vanilla, attn_len=args.attn_len,
                                      stride=args.stride, per_token=bool(args.per_token), mask_prob=args.mask_prob,
                                      seed=args.mask_seed, dynamic_lr=args.dynamic_lr,
                                      dynamic_decay=args.dynamic_decay, **common)
    _check_finite(result, ckpt, args)
    out = result.to_dict()
    out["checkpoint"] = str(ckpt.path)
    out["data"] = f"text:{Path(args.text).absolute()} (the checkpoint's vocabulary)" if args.text else (
        args.data or ckpt.data_spec)
    if args.per_token:
        out["per_token"] = str(save_per_token(nll, args.per_token))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"checkpoint  {ckpt.path}\ndata        {out['data']}")
        print(result_table(result))
        if args.per_token:
            print(f"per-token NLL (nats, corpus order) -> {out['per_token']}")
    return 0


def _run_classify(args: argparse.Namespace, ckpt, device) -> int:
    """A classifier run (`txl train --objective classify`): accuracy, macro-F1, per-class scores and the confusion
    matrix of a split of its documents (or of --data docs:OTHER with the same labels), as a table or --json."""
    from txl.data.documents import open_documents
    from txl.eval.classify import evaluate_classifier, format_report
    from txl.eval.precision import resolve_precision

    lm_only = [flag for flag, given in (("--text", args.text), ("--vanilla", args.vanilla), ("--sweep-mem", args.sweep_mem),
                                        ("--dynamic-lr", args.dynamic_lr is not None), ("--per-token", args.per_token),
                                        ("--mask-prob", args.mask_prob is not None), ("--max-tokens", args.max_tokens))
               if given]
    if lm_only:
        raise UsageError(f"{ckpt.path} is a document classifier: {', '.join(lm_only)} apply to language models; "
                         "give --data docs:DIR, --split, --tgt-len, --mem-len, --batch-size, --json")
    spec = args.data or ckpt.data_spec
    if not spec:
        raise UsageError(f"{ckpt.path} does not record its documents; give --data docs:DIR")
    corpus = open_documents(spec, vocab=ckpt.vocab)
    config = ckpt.model.config
    if len(corpus.labels) != config.num_labels:
        raise UsageError(f"{spec} has {len(corpus.labels)} labels ({', '.join(corpus.labels[:10])}) but {ckpt.path} "
                         f"classifies into {config.num_labels}; score it on documents of the labels it learned")
    split = args.split
    if split is None:
        split = next(s for s in ("valid", "test", "train") if s in corpus.splits)
        if split == "train":
            print(f"note: {spec} has no valid or test documents; scoring train, which the run learned from",
                  file=sys.stderr)
    tgt_len = args.tgt_len or ckpt.train_setting("eval_tgt_len") or ckpt.train_setting("tgt_len") or 128
    scores = evaluate_classifier(ckpt.model, corpus, split, tgt_len=tgt_len, batch_size=args.batch_size,
                                 mem_len=args.mem_len, device=device, precision=resolve_precision(args.precision, device))
    out = scores.to_dict()
    out["checkpoint"], out["data"] = str(ckpt.path), spec
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"checkpoint  {ckpt.path}\ndata        {spec}")
        print(format_report(scores))
    return 0


def _check_text_encoding(ckpt, args: argparse.Namespace) -> None:
    """A UTF-16 or UTF-32 file scored with a character or word vocabulary: one line with the iconv command
    (it read as "not UTF-8 at byte 0", or, without a byte-order mark, as an unknown character NUL)."""
    if ckpt.vocab is None or getattr(ckpt.vocab, "kind", None) not in ("chars", "words"):
        return  # bytes and byte-level BPE read any bytes
    from txl.data import parse_spec
    from txl.data.segment import SNIFF, Segment, check_utf8_text, read_at

    path = None
    if args.text:
        path = Path(args.text).expanduser()
    elif args.data and args.split == "all":  # --data text:FILE --split all: the file read with this vocabulary
        spec = parse_spec(args.data)
        path = Path(spec.path) if spec.name == "text" and spec.path else None
    try:
        is_file = path is not None and path.is_file()
    except (OSError, ValueError):  # a name too long or with a NUL: the reader names it later
        is_file = False
    if is_file:
        check_utf8_text(path, read_at(Segment(path, 0, SNIFF), 0, SNIFF), f"a {ckpt.vocab.kind} vocabulary reads UTF-8")


def _default_split(ckpt, data: str | None) -> str:
    """valid when the corpus has it; else test (held out too), else train with a note that it is the text the
    run learned from. A run trained on a folder with only train.txt has no valid split, and the `txl eval
    RUN` that `txl train` prints next must still work (issue 45)."""
    spec = data or ckpt.data_spec
    if not spec:
        return "valid"  # open_eval_corpus names the missing --data
    from txl.data import parse_spec
    from txl.data.spec import SEQ2SEQ_CORPORA

    parsed = parse_spec(spec)
    if parsed.name in SEQ2SEQ_CORPORA:
        if ckpt.run.get("validation") is not False:  # the run validated: its corpus has valid pairs
            return "valid"
        from txl.data.seq2seq import open_pair_corpus

        splits = open_pair_corpus(parsed, vocab=ckpt.vocab).splits
    else:
        from txl.data.readers import make_plan

        splits = make_plan(parsed).splits  # which files form each split; no text is read
    if "valid" in splits:
        return "valid"
    if "test" in splits:
        print(f"note: {spec} has no valid split; scoring test, its held-out text (--split to choose)",
              file=sys.stderr)
        return "test"
    held_out = "valid.txt beside train.txt" if parsed.name == "text" else "a valid file beside the train file"
    print(f"note: {spec} has no valid or test split; scoring train, the text the run learned from, so the score "
          f"flatters the model (for a fair one hold some text out: {held_out})", file=sys.stderr)
    return "train"


def model_summary(config) -> str:
    """One phrase naming the model: a Transformer's layers and width, or the recurrent arch's sizes."""
    if config.arch == "lstm":
        return f"AWD-LSTM, {config.n_layer} layers, hidden {config.d_inner}, embedding {config.d_model}"
    if config.arch == "sha-rnn":
        return f"SHA-RNN, {config.n_layer} blocks, width {config.d_model}, Boom {config.d_inner}"
    return f"{config.n_layer} layers, d_model {config.d_model}"


def memory_meaning(config) -> str:
    """What the sweep's memory length means for this model (the x-axis of the sweep)."""
    if config.arch == "lstm":
        return ("mem_len > 0 carries each stream's LSTM state across segments (its value does not matter; "
                "0 starts every segment from a zero state); attention length = mem_len + tgt_len as for a Transformer")
    if config.arch == "sha-rnn":
        return ("attention length = mem_len + tgt_len (states the last query of the attention layer sees); "
                "mem_len > 0 also carries the LSTM state")
    return "attention length = mem_len + tgt_len (keys the last query of a segment sees)"


def _check_finite(result, ckpt, args: argparse.Namespace) -> None:
    import math

    from txl.errors import CheckpointError

    if not math.isfinite(result.loss) and not args.allow_nonfinite:
        fix = "use another checkpoint" + ("" if args.precision == "fp32" else " or --precision fp32")
        raise CheckpointError(f"{ckpt.path} scored a non-finite loss ({result.loss}) on {args.split}: its weights hold "
                              f"NaN/Inf or overflow at {args.precision}; {fix} (--allow-nonfinite reports it anyway)")


def _cpu_name() -> str | None:
    try:
        return next((ln.split(":", 1)[1].strip() for ln in read_proc("/proc/cpuinfo").splitlines()
                     if ln.startswith("model name")), None)
    except OSError:
        return None


def _run_sweep(args: argparse.Namespace, ckpt, mem_lens: list[int], common: dict) -> int:
    import platform

    import torch

    from txl.eval.api import evaluate_checkpoint
    from txl.eval.precision import resolve_precision
    from txl.eval.report import plain, plot_sweep, sweep_markdown

    results = []
    for mem_len in mem_lens:
        result, _ = evaluate_checkpoint(ckpt, mem_len=mem_len, **common)
        _check_finite(result, ckpt, args)
        results.append(result)
        if not args.json:
            print(f"mem_len {mem_len}: {result.metric} {result.value:.4f} ({result.tokens:,} tokens, "
                  f"{result.seconds:.1f} s)", file=sys.stderr, flush=True)
    config = ckpt.model.config
    train_tgt = ckpt.train_setting("tgt_len")
    train_attn = config.mem_len + train_tgt if train_tgt else None
    data = args.data or ckpt.data_spec
    header = (f"# Evaluation memory sweep\n\n- checkpoint: `{ckpt.path}` ({model_summary(config)}, trained with "
              f"mem_len {config.mem_len}" + (f", tgt_len {train_tgt}" if train_tgt else "") + ")\n"
              f"- data: `{data}`, split {args.split}"
              + (f", first {args.max_tokens:,} targets" if args.max_tokens else "") + "\n"
              f"- settings: tgt_len {results[0].tgt_len}, batch {args.batch_size} streams, warm memory "
              f"{args.warm_memory}, same_length {results[0].same_length}, clamp_len {results[0].clamp_len}, "
              f"{resolve_precision(args.precision, common['device'])}\n"
              f"- {memory_meaning(config)}\n"
              f"- machine: {_cpu_name() or platform.machine()}, {torch.get_num_threads()} torch threads, torch "
              f"{torch.__version__}, {time.strftime('%Y-%m-%d')}\n\n")
    table = sweep_markdown(results)
    prefix = Path(args.sweep_out)
    run_name = ckpt.path.parent.name if ckpt.path.name in ("best", "last") else ckpt.path.name
    png = plot_sweep(results, prefix.with_suffix(".png"), train_attn_len=train_attn,
                     title=plain(f"{run_name}: {results[0].metric} vs attention length ({args.split})"))
    try:
        write_file(prefix.with_suffix(".md"), header + table + f"\n![sweep]({png.name})\n")
        write_file(prefix.with_suffix(".json"), json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    except OSError as err:
        raise OutputError(f"cannot write {prefix}.md/.json: {describe_os_error(err)}") from None
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(table)
        print(f"wrote {prefix.with_suffix('.md')}, {png}, {prefix.with_suffix('.json')}")
    return 0
