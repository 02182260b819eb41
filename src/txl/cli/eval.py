"""`txl eval`, `txl generate` and `txl recl`: argument parsing and printing.

Kept free of torch at import time (`txl --help` imports every subcommand's `configure`); the work is
done by `txl.eval`, `txl.generate.decoder` and `txl.eval.recl`, imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from txl.cli.arguments import MAX_BEAM, MAX_LENGTH_PENALTY, integer, real
from txl.errors import OutputError, UsageError, describe_os_error
from txl.io import STATE_LIMIT, read_proc, read_text
from txl.io import write_text as write_file

PRECISIONS = ("fp32", "bf16", "fp16", "auto")


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
        raise UsageError(f"{flag}: memory lengths must be <= {MAX_LENGTH:,}, got {_shown(max(values))}")
    return values


def _device(name: str) -> str:
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    return name


def _add_checkpoint(parser: argparse.ArgumentParser, nargs: str | None = None) -> None:
    parser.add_argument("checkpoint", nargs=nargs, metavar="CKPT",
                        help="a checkpoint directory (config.json + model.safetensors + vocab.json) or a "
                             "`txl train` run directory (uses RUN/best, else RUN/last)")


# Lengths (tokens) and counts a command takes are bounded where they are parsed: an int of 30 digits
# would otherwise overflow deep inside torch (OverflowError) instead of being named here.
MAX_LENGTH = 1 << 24
MAX_COUNT = 1 << 62  # --max-tokens, --positions
BEAM_SIZE = integer(1, MAX_BEAM)
LENGTH_PENALTY = real(0, MAX_LENGTH_PENALTY)


def _shown(value: int) -> str:
    return f"{value:.3g}" if abs(value) >= 10**15 else str(value)


def _check_nonnegative(args: argparse.Namespace, *names: str, limit: int = MAX_LENGTH) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if value is not None and value > limit:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {limit:,}, got {_shown(value)}")


def _check_positive(args: argparse.Namespace, *names: str, limit: int = MAX_LENGTH) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if value is not None and value > limit:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {limit:,}, got {_shown(value)}")


# ---------------------------------------------------------------------------------------------
# txl eval


def configure_eval(parser: argparse.ArgumentParser) -> None:
    _add_checkpoint(parser)
    parser.add_argument("--data", metavar="SPEC", help="data spec (default: the corpus the run trained on); "
                                                       "text:FILE with --split all scores FILE with the run's vocabulary")
    parser.add_argument("--split", default="valid",
                        help="valid, test, train, or all (a whole text file: --data text:FILE); default valid")
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
    seq2seq = parser.add_argument_group("sequence-to-sequence runs (arch = encoder-decoder)")
    seq2seq.add_argument("--beam-size", type=BEAM_SIZE, default=4, help="beam search width next to greedy (default 4)")
    seq2seq.add_argument("--length-penalty", type=LENGTH_PENALTY, default=0.6,
                         help="GNMT alpha of beam search (default 0.6)")
    seq2seq.add_argument("--samples", type=integer(0, 100_000), default=10,
                         help="sample outputs printed next to references")
    seq2seq.add_argument("--max-pairs", type=integer(0, MAX_COUNT), default=0,
                         help="score only the first N pairs (0 = all)")
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


def run_eval(args: argparse.Namespace) -> int:
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
    _check_nonnegative(args, "mem_len", "clamp_len", "batch_size")
    _check_nonnegative(args, "max_tokens", limit=MAX_COUNT)
    _check_positive(args, "tgt_len", "attn_len", "stride")
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
    if args.text and args.split not in ("valid", "all"):
        raise UsageError(f"--text scores the whole file; drop --split {args.split}")
    sweep = _int_list(args.sweep_mem, "--sweep-mem") if args.sweep_mem else None
    from txl.eval.api import evaluate_checkpoint
    from txl.eval.report import result_table, save_per_token
    from txl.models.checkpoint import load_checkpoint

    device = _device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device)
    if ckpt.model.config.arch == "encoder-decoder":
        from txl.cli.seq2seq import run_eval as run_seq2seq_eval

        if args.dynamic_lr is not None:
            raise UsageError(f"{ckpt.path} is an encoder-decoder: dynamic evaluation applies to causal LMs")

        _check_nonnegative(args, "samples", "max_pairs")
        _check_positive(args, "beam_size")
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


# ---------------------------------------------------------------------------------------------
# txl generate


def configure_generate(parser: argparse.ArgumentParser) -> None:
    _add_checkpoint(parser)
    parser.add_argument("--prompt", help="text to continue, encoded with the checkpoint's vocab.json (\"\" or no "
                                         "prompt at all: generate unconditionally, from the corpus's line boundary)")
    parser.add_argument("--prompt-file", metavar="FILE",
                        help="a batch of prompts: one per line of FILE (UTF-8; blank lines are skipped)")
    parser.add_argument("--num-samples", type=int, default=1, metavar="K",
                        help="continuations per prompt, sampled together as one batch (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, help="softmax temperature (default 1.0; 0 = greedy)")
    parser.add_argument("--top-k", type=int,
                        help="sample among the k most likely tokens (0 = all; default 40, the paper's appendix E)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1 = off)")
    parser.add_argument("--greedy", action="store_true",
                        help="always take the most likely token (not with --temperature, --top-k, --top-p)")
    parser.add_argument("--stop", action="append", default=[], metavar="STRING",
                        help="end a sample at this string, which is not printed (repeatable; \\n and \\t are "
                             "newline and tab)")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="end a sample at the vocabulary's <eos> (word vocabularies: the end of a line)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: random)")
    parser.add_argument("--mem-len", type=int,
                        help="memory per layer while generating (default: the checkpoint's; 0 = re-run a "
                             "sliding window of the training segment length each step)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document: each sample's text, token ids and per-token log-probabilities")
    parser.add_argument("--no-echo", dest="echo", action="store_false", help="do not print the prompt first")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    seq2seq = parser.add_argument_group("sequence-to-sequence runs (arch = encoder-decoder)")
    seq2seq.add_argument("--input", metavar="FILE", help="decode one source per line of FILE, one output per line "
                                                         "(--max-new-tokens caps each output)")
    seq2seq.add_argument("--beam-size", type=BEAM_SIZE, default=4, help="beam search width (1 = greedy; default 4)")
    seq2seq.add_argument("--length-penalty", type=LENGTH_PENALTY, default=0.6,
                         help="GNMT alpha of beam search (default 0.6)")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts to continue: --prompt (one; "" = unconditional), --prompt-file (one per line) or
    none at all (one unconditional sample)."""
    if args.prompt is not None and args.prompt_file:
        raise UsageError("give --prompt or --prompt-file, not both")
    if args.prompt_file:
        # a path the user typed (a link is followed), bounded and regular (a FIFO would wait for ever)
        text = read_text(args.prompt_file, what="prompt file", limit=STATE_LIMIT, error=UsageError, follow_links=True)
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"prompt file {args.prompt_file} has no prompts (one per line)")
        return prompts
    return [args.prompt or ""]


def _sampling_settings(args: argparse.Namespace) -> tuple[float, int, float]:
    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                      ("--top-p", args.top_p)) if value is not None]
    if args.greedy:
        if given:
            raise UsageError(f"--greedy takes the most likely token; it does not combine with {given[0]}")
        if args.num_samples > 1:
            raise UsageError(f"--greedy gives {args.num_samples} identical samples; drop --greedy or --num-samples")
        return 0.0, 0, 1.0
    temperature = 1.0 if args.temperature is None else args.temperature
    if temperature == 0 and args.num_samples > 1:
        raise UsageError(f"--temperature 0 is greedy: {args.num_samples} identical samples; raise the temperature")
    return temperature, 40 if args.top_k is None else args.top_k, 1.0 if args.top_p is None else args.top_p


def _unescape(text: str) -> str:
    return text.replace("\\\\", "\0").replace("\\n", "\n").replace("\\t", "\t").replace("\0", "\\")


def write_text(text: str) -> None:
    """Generated text to stdout: control bytes escaped on a terminal; always valid UTF-8."""
    from txl.data.display import json_text, terminal_text

    sys.stdout.write(terminal_text(text) if sys.stdout.isatty() else json_text(text))
    sys.stdout.flush()


def run_generate(args: argparse.Namespace) -> int:
    if args.input:
        from txl.cli.seq2seq import run_generate as run_seq2seq_generate

        return run_seq2seq_generate(args)
    from txl.generate.decoder import check_sampling, check_seed

    prompts = read_prompts(args)
    temperature, top_k, top_p = _sampling_settings(args)
    check_sampling(args.max_new_tokens, temperature, top_k, top_p)
    check_seed(args.seed)
    _check_nonnegative(args, "mem_len")
    _check_positive(args, "num_samples")
    stops = [_unescape(s) for s in args.stop]
    if any(not s for s in stops):
        raise UsageError("--stop needs a non-empty string")
    import torch

    from txl.generate.decoder import check_causal, encode_prompt, sample_text
    from txl.models.checkpoint import load_checkpoint

    device = _device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, require_vocab=True)
    if ckpt.model.config.arch == "encoder-decoder":
        raise UsageError(f"{ckpt.path} is a sequence-to-sequence model: decode sources with --input FILE")
    check_causal(ckpt.model)  # before anything is printed
    for prompt in prompts:  # every prompt is checked before anything is printed
        encode_prompt(ckpt.vocab, prompt)
    if args.stop_at_eos and ckpt.vocab.eos_id is None:
        raise UsageError(f"this {ckpt.vocab.kind} vocabulary has no <eos> symbol to stop at; use --stop STRING")
    mem_len = ckpt.model.mem_len if args.mem_len is None else args.mem_len
    window = ckpt.train_setting("tgt_len") if mem_len == 0 else None  # the vanilla model's training window
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    settings = dict(max_new_tokens=args.max_new_tokens, num_samples=args.num_samples, stop=stops,
                    stop_at_eos=args.stop_at_eos, temperature=temperature, top_k=top_k, top_p=top_p, mem_len=mem_len,
                    segment_len=window, generator=generator)
    if args.json:
        samples = sample_text(ckpt.model, ckpt.vocab, prompts, **settings)
        settings.pop("generator")
        print(json.dumps({"checkpoint": str(ckpt.path), "seed": args.seed, "settings": settings,
                          "samples": [s.to_dict() for s in samples]}, indent=2, ensure_ascii=False))
        return 0
    if len(prompts) == 1 and args.num_samples == 1:  # stream the one sample as it is produced
        if args.echo:
            write_text(prompts[0])
        sample_text(ckpt.model, ckpt.vocab, prompts, on_text=lambda i, piece: write_text(piece), **settings)
        write_text("\n")
        return 0
    total = len(prompts) * args.num_samples
    for n, prompt in enumerate(prompts):
        for k, s in enumerate(sample_text(ckpt.model, ckpt.vocab, [prompt], **settings)):
            index = n * args.num_samples + k + 1
            write_text(f"{'' if index == 1 else chr(10)}=== sample {index}/{total} (prompt {n + 1}, "
                       f"{len(s.ids)} tokens, stopped by {s.stopped_by}) ===\n")
            write_text((prompt if args.echo else "") + s.text + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# txl recl


def configure_recl(parser: argparse.ArgumentParser) -> None:
    _add_checkpoint(parser, nargs="+")
    parser.add_argument("--data", help="data spec (default: the corpus the first checkpoint trained on)")
    parser.add_argument("--split", default="valid", help="valid or test (default: valid)")
    parser.add_argument("--contexts", required=True, metavar="C1,C2,... | START:STOP:STEP",
                        help="context lengths, increasing; consecutive pairs are the (c, c + Δ) steps")
    parser.add_argument("--r", default="0.1,0.5,1.0", help="top-r ratios of hard tokens (default 0.1,0.5,1.0)")
    parser.add_argument("--threshold", type=float, default=0.01, help="relative gain threshold (paper: 0.01)")
    parser.add_argument("--mode", choices=["window", "memory"], default="window",
                        help="how context length c is realised: window = a fresh forward over exactly the c "
                             "previous tokens (the definition; default); memory = mem_len c with same_length "
                             "(attention length c; reach up to n_layer × c)")
    parser.add_argument("--positions", type=int,
                        help="score this many positions, evenly spaced (0 = all; default 2000 in window mode, "
                             "all in memory mode)")
    parser.add_argument("--max-tokens", type=int, default=0, help="only use the first N tokens of the split")
    parser.add_argument("--tgt-len", type=int, default=128,
                        help="memory mode: segment length (default 128; with same_length every query still sees "
                             "exactly c keys)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="window mode: windows per forward (0 = automatic); memory mode: streams (0 = 1)")
    parser.add_argument("--names", help="comma-separated labels for the checkpoints (default: run names)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16/fp16 autocast, or auto = bf16 where the device has fast bf16 (default fp32)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    parser.add_argument("--cache", metavar="DIR",
                        help="store per-token losses here and reuse them (resumable; change r or the "
                             "threshold without recomputing)")
    parser.add_argument("--vanilla-context", choices=["train", "full"], default="train",
                        help="window mode, models with absolute positions and no memory (vanilla Transformers): "
                             "train = they read at most their training segment length, as the paper's vanilla "
                             "model (default); full = every window is fed whole")
    parser.add_argument("--out", metavar="PREFIX", help="write PREFIX.md, PREFIX.json and PREFIX.png")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _label(path: Path) -> str:
    return path.parent.name if path.name in ("best", "last") else path.name


def run_recl(args: argparse.Namespace) -> int:
    from txl.eval.recl import choose_positions, parse_contexts, parse_rs

    contexts = parse_contexts(args.contexts)
    rs = parse_rs(args.r)
    _check_nonnegative(args, "batch_size")
    _check_nonnegative(args, "positions", "max_tokens", limit=MAX_COUNT)
    _check_positive(args, "tgt_len")
    if not 0 < args.threshold < 1:
        raise UsageError(f"--threshold must be in (0, 1), got {args.threshold}")
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    if names is not None and len(names) != len(args.checkpoint):
        raise UsageError(f"--names gives {len(names)} labels for {len(args.checkpoint)} checkpoints")

    from txl.eval.corpus import open_eval_corpus
    from txl.eval.result import metric_value
    from txl.eval.recl import (
        compute_recl,
        context_losses,
        fixed_context,
        plot_recl,
        recl_markdown,
        weights_key,
    )
    from txl.models.checkpoint import load_checkpoint

    device = _device(args.device)
    ckpts = [load_checkpoint(path, device=device) for path in args.checkpoint]
    names = names or [_label(c.path) for c in ckpts]
    if len(set(names)) != len(names):
        raise UsageError(f"two checkpoints have the same label ({names}); give --names")
    data = args.data or ckpts[0].data_spec
    corpus = tokens = None
    read_as = set()
    for ckpt in ckpts:  # every model must read the same corpus with the same vocabulary
        corpus, tokens = open_eval_corpus(ckpt, data, args.split)
        read_as.add(corpus.fingerprint)
    if len(read_as) > 1:  # e.g. an imported model (its own fixed vocabulary) next to one trained on the corpus
        raise UsageError(f"the checkpoints read {data} with different vocabularies, so their token streams differ; "
                         "RECL compares models on the same tokens")
    positions_count = args.positions if args.positions is not None else (2000 if args.mode == "window" else 0)
    positions = choose_positions(len(tokens), contexts[-1], positions_count, max_tokens=args.max_tokens)

    def log(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    losses = {}
    capped = {}
    started = time.perf_counter()
    for name, ckpt in zip(names, ckpts):
        cap = fixed_context(ckpt.model.config, ckpt.train_setting("tgt_len")) if args.vanilla_context == "train" else None
        if cap is not None and args.mode == "window":
            capped[name] = cap
            log(f"{name}: absolute positions, no memory: reads at most its training length {cap} (--vanilla-context)")
        log(f"{name}: {args.mode} mode, {len(positions):,} positions, contexts {contexts}")
        key = f"{weights_key(ckpt.path)}|{corpus.fingerprint}|{args.split}|{ckpt.model.clamp_len}"
        losses[name] = context_losses(ckpt.model, tokens, positions, contexts, mode=args.mode, tgt_len=args.tgt_len,
                                      batch_size=args.batch_size, device=device, precision=args.precision,
                                      cache=Path(args.cache) if args.cache else None, cache_key=key,
                                      log=lambda m, n=name: log(f"{n}: {m}"), max_context=capped.get(name))
    result = compute_recl(losses, contexts, rs, threshold=args.threshold)
    result.info = {"data": data, "split": args.split, "mode": args.mode, "checkpoints": [str(c.path) for c in ckpts],
                   "metric": corpus.metric, "seconds": time.perf_counter() - started,
                   "tgt_len": args.tgt_len if args.mode == "memory" else None,
                   "first_position": int(positions[0]), "last_position": int(positions[-1]),
                   "fixed_context": capped}
    table = recl_markdown(result, metric=corpus.metric)
    if args.out:
        prefix = Path(args.out)
        png = plot_recl(result, prefix.with_suffix(".png"), metric=corpus.metric)
        header = (f"RECL ({args.mode} mode) on `{data}` {args.split}: {len(positions):,} positions "
                  f"(targets {positions[0]:,} … {positions[-1]:,}), contexts {contexts}, threshold "
                  f"{args.threshold:g}\n\n")
        try:
            write_file(prefix.with_suffix(".md"), header + table + f"\n![RECL]({png.name})\n")
            write_file(prefix.with_suffix(".json"), json.dumps(result.to_dict(), indent=2) + "\n")
        except OSError as err:
            raise OutputError(f"cannot write {prefix}.md/.json: {describe_os_error(err)}") from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(table)
        best = {n: metric_value(min(result.mean_loss[n]), corpus.metric) for n in names}
        print("best " + corpus.metric + ": " + ", ".join(f"{n} {v:.4f}" for n, v in best.items()))
        if args.out:
            print(f"wrote {Path(args.out).with_suffix('.md')}, .json, .png")
    return 0
