"""`txl generate`: continue a prompt with a checkpoint, reusing memory; streams text to stdout. An
encoder-decoder run decodes `--input FILE` through `txl.cli.seq2seq`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from txl.cli.arguments import (
    BEAM_SIZE,
    LENGTH_PENALTY,
    add_checkpoint,
    add_threads,
    check_nonnegative,
    check_positive,
    resolve_device,
)
from txl.data.segment import SNIFF, check_utf8_text
from txl.errors import UsageError
from txl.io import STATE_LIMIT, read_bytes


def configure(parser: argparse.ArgumentParser) -> None:
    add_checkpoint(parser)
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
    add_threads(parser)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    style = parser.add_argument_group("style-transfer runs (arch = style-transformer)")
    style.add_argument("--style", metavar="S", help="rewrite --prompt (or each line of --prompt-file or --input) in "
                                                   "style S (a name the run's corpus gave, or its index), greedily")
    seq2seq = parser.add_argument_group("sequence-to-sequence runs (arch = encoder-decoder, rnn-seq2seq)")
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
        data = read_bytes(args.prompt_file, what="prompt file", limit=STATE_LIMIT, error=UsageError, follow_links=True)
        check_utf8_text(Path(args.prompt_file), data[:SNIFF], "prompts are read as UTF-8")  # UTF-16: iconv line
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(f"prompt file {args.prompt_file} is not UTF-8 text (byte {err.start}); prompts are "
                             "read as UTF-8") from None
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


def run(args: argparse.Namespace) -> int:
    if args.style is not None:  # a Style Transformer run (txl.models.style)
        from txl.cli.style import run_transfer

        return run_transfer(args, read_prompts=read_prompts)
    if args.input:
        from txl.cli.seq2seq import run_generate as run_seq2seq_generate

        return run_seq2seq_generate(args)
    from txl.nn.sampling import check_sampling, check_seed

    prompts = read_prompts(args)
    temperature, top_k, top_p = _sampling_settings(args)
    check_sampling(args.max_new_tokens, temperature, top_k, top_p)
    check_seed(args.seed)
    check_nonnegative(args, "mem_len")
    check_positive(args, "num_samples")
    stops = [_unescape(s) for s in args.stop]
    if any(not s for s in stops):
        raise UsageError("--stop needs a non-empty string")
    import torch

    from txl.generate.decoder import check_causal
    from txl.generate.text import encode_prompt, prompt_notice, sample_text
    from txl.models.checkpoint import load_checkpoint

    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, require_vocab=True)
    from txl.models.registry import not_a_language_model

    other = not_a_language_model(ckpt.model.config)
    if other is not None:
        raise UsageError(f"{ckpt.path} is {other[0]}: {other[1]}")
    check_causal(ckpt.model)  # before anything is printed
    for number, prompt in enumerate(prompts, 1):  # every prompt is checked before anything is printed
        encode_prompt(ckpt.vocab, prompt)
        notice = prompt_notice(ckpt.vocab, prompt)  # words read as <unk> (issue 45: they were replaced silently)
        if notice is not None:
            where = f"prompt {number}: " if len(prompts) > 1 else ""
            print(f"txl generate: warning: {where}{notice}", file=sys.stderr)
    if args.stop_at_eos and ckpt.vocab.eos_id is None:
        raise UsageError(f"this {ckpt.vocab.kind} vocabulary has no <eos> symbol to stop at; use --stop STRING")
    mem_len = ckpt.model.mem_len if args.mem_len is None else args.mem_len
    # the vanilla model's training window; an absolute encoding's positions restart every training segment
    absolute = getattr(ckpt.model, "takes_position_ids", False)
    window = ckpt.train_setting("tgt_len") if mem_len == 0 or absolute else None
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
