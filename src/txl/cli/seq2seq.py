"""`txl eval RUN` and `txl generate RUN --input FILE` for sequence-to-sequence runs (arch = encoder-decoder or
rnn-seq2seq).

`txl eval` scores a split teacher-forced (loss, token accuracy) and decoded (exact match, ROUGE-1/2/L,
greedy and beam search), then prints a table of sample outputs next to their references.
`txl generate --input FILE` decodes one source per line of FILE and prints one output per line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from txl.data.display import for_stream
from txl.errors import DataError, UsageError
from txl.io import STATE_LIMIT, read_text


def _corpus(ckpt, data: str | None):
    from txl.data.seq2seq import open_pair_corpus

    spec = data or ckpt.data_spec
    if spec is None:
        raise UsageError(f"{ckpt.path} records no corpus; name one with --data SPEC")
    corpus = open_pair_corpus(spec, vocab=ckpt.vocab)
    return corpus


def run_eval(args: argparse.Namespace, ckpt, device) -> int:
    """Teacher-forced and decoded scores of one split, and `--samples` outputs against references."""
    from txl.eval.seq2seq import decode_split, teacher_forced

    if args.text or args.vanilla or args.sweep_mem or args.per_token:
        raise UsageError("--text, --vanilla, --sweep-mem and --per-token apply to language models; a "
                         "sequence-to-sequence run is scored on a split of its pair corpus (--split, --data)")
    corpus = _corpus(ckpt, args.data)
    split = args.split
    if split not in corpus.splits:
        raise UsageError(f"the corpus has no split {split!r} (splits: {', '.join(corpus.splits)})")
    model = ckpt.model
    forced = teacher_forced(model, corpus, split, batch_size=max(args.batch_size, 32), device=device,
                            precision=args.precision, max_pairs=args.max_pairs)
    beams = sorted({1, args.beam_size})
    decoded = [decode_split(model, corpus, split, beam_size=b, alpha=args.length_penalty, device=device,
                            max_pairs=args.max_pairs, n_samples=args.samples) for b in beams]
    out = {"checkpoint": str(ckpt.path), "data": corpus.spec, "split": split, "pairs": forced.pairs,
           "loss": forced.loss, "ppl": forced.value, "token_accuracy": forced.token_accuracy,
           "decoded": [d.to_dict() for d in decoded]}
    baseline = None
    if corpus.name == "pydoc-summaries":  # the trivial summary: the function's name split into words
        from txl.data.pydoc import name_baseline
        from txl.eval.seq2seq_metrics import exact_match, rouge

        guesses = name_baseline(corpus, split, args.max_pairs)
        references = [t for _, t in corpus.references(split)][: len(guesses)]
        baseline = {"method": "function name", "exact_match": exact_match(guesses, references),
                    **(rouge(guesses, references) or {})}
        out["baseline"] = baseline
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    print(f"checkpoint  {ckpt.path}\ndata        {corpus.spec} ({split}, {forced.pairs:,} pairs)")
    print(f"teacher-forced: loss {forced.loss:.4f} nats/token, ppl {forced.value:.3f}, "
          f"token accuracy {100 * forced.token_accuracy:.2f}%")
    print("\n| decoding | exact match | ROUGE-1 | ROUGE-2 | ROUGE-L | seconds |\n|---|---|---|---|---|---|")
    for d in decoded:
        rouge = " | ".join("-" if d.rouge is None else f"{100 * d.rouge[k]:.2f}" for k in ("rouge1", "rouge2", "rougeL"))
        print(f"| {d.method} | {100 * d.exact_match:.2f}% | {rouge} | {d.seconds:.1f} |")
    if baseline is not None:
        rouge = " | ".join(f"{100 * baseline[k]:.2f}" if k in baseline else "-" for k in ("rouge1", "rouge2", "rougeL"))
        print(f"| baseline: function name in words | {100 * baseline['exact_match']:.2f}% | {rouge} | - |")
    if decoded[0].rouge is None:
        print("(ROUGE needs the optional package rouge-score: pip install 'txl[seq2seq]')")
    if args.samples:
        best = decoded[-1]
        print(f"\nsamples ({best.method}):\n\n| source | reference | output |\n|---|---|---|")
        for s in best.samples:
            cells = [for_stream(_cell(s[k]), sys.stdout) for k in ("source", "reference", "output")]
            print("| " + " | ".join(cells) + " |")
    return 0


def _cell(text: str, width: int = 80) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def run_generate(args: argparse.Namespace) -> int:
    """One output per source line of --input (blank lines skipped), decoded in batches."""
    from txl.cli.arguments import resolve_device
    from txl.data.seq2seq import collate
    from txl.generate.seq2seq import beam_search, greedy, sample
    from txl.models.checkpoint import load_checkpoint
    from txl.nn.sampling import check_sampling, check_seed

    if args.prompt is not None or args.prompt_file:
        raise UsageError("give --input FILE (one source per line) for a sequence-to-sequence run, not --prompt")
    if args.beam_size < 1:
        raise UsageError(f"--beam-size must be >= 1, got {args.beam_size}")
    # the numbers a language model's generation checks, checked here too (a nan temperature meant greedy)
    check_sampling(args.max_new_tokens, 0.0 if args.temperature is None else args.temperature, args.top_k or 0,
                   1.0 if args.top_p is None else args.top_p)
    check_seed(args.seed)
    sampling = args.temperature is not None and args.temperature > 0
    if sampling and args.beam_size > 1:
        raise UsageError("--temperature samples; it does not combine with --beam-size")
    text = read_text(args.input, what="input file", limit=STATE_LIMIT, error=UsageError, follow_links=True)
    sources = [line for line in text.splitlines() if line.strip()]
    if not sources:
        raise UsageError(f"input file {args.input} has no sources (one per line)")
    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.checkpoint, device=device, require_vocab=True)
    from txl.generate.decoder import check_causal
    from txl.models.registry import is_seq2seq, not_a_language_model

    if not is_seq2seq(ckpt.model.config):
        other = not_a_language_model(ckpt.model.config)
        if other is not None:
            raise UsageError(f"{ckpt.path} is {other[0]}: {other[1]}")
        check_causal(ckpt.model)
        raise UsageError(f"{ckpt.path} is a language model: continue text with --prompt, not --input")
    vocab = ckpt.vocab
    encoded = []
    for n, text in enumerate(sources, 1):
        try:
            encoded.append((vocab.source.encode(text), []))
        except DataError as err:
            raise UsageError(f"{args.input}:{n}: {err}") from None
    max_len = args.max_new_tokens
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    outputs = []
    for start in range(0, len(encoded), 32):
        batch = collate(encoded[start: start + 32], vocab)
        src, mask = batch.source.to(device), batch.attention_mask.to(device)
        common = dict(bos=vocab.target.bos_id, eos=vocab.target.eos_id, max_len=max_len)
        if sampling:
            result = sample(ckpt.model, src, mask, temperature=args.temperature, top_k=args.top_k or 0,
                            generator=generator, **common)
        elif args.beam_size > 1:
            result = beam_search(ckpt.model, src, mask, beam_size=args.beam_size, alpha=args.length_penalty, **common)
        else:
            result = greedy(ckpt.model, src, mask, **common)
        outputs += [(vocab.target.decode(t), s) for t, s in zip(result.tokens, result.scores)]
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt.path), "outputs": [
            {"source": src, "output": out, "score": score} for src, (out, score) in zip(sources, outputs)]},
            indent=2, ensure_ascii=False))
        return 0
    for out, _ in outputs:
        print(for_stream(out.replace("\n", " "), sys.stdout))
    return 0
