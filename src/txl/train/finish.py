"""After training: final scores with the best weights, a sample, result.json and a summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from txl.checkpoint import write_json
from txl.model import TransformerXL
from txl.rundir import write_text
from txl.train.state import BEST

if TYPE_CHECKING:
    from txl.train.loop import Trainer


def finish(trainer: Trainer, summary: dict) -> dict:
    """Evaluate the final splits with the best weights, print a table and a sample; write result.json."""
    cfg = trainer.cfg
    results = {}
    if trainer.dist.world > 1:
        dist.barrier()  # rank 0 has finished writing `best`
    if (trainer.out / BEST).is_dir():
        best = TransformerXL.from_pretrained(trainer.out / BEST, map_location=trainer.dist.device)
        trainer.model.load_state_dict(best.state_dict())
    for split in cfg.final_splits:
        if split not in trainer.corpus.splits:
            continue
        result = trainer.evaluate_split(split, max_tokens=cfg.eval_max_tokens, progress=True)
        results[split] = result.to_dict()
    summary = {**summary, "final": results, "metric": trainer.metric,
               "parameters": trainer.model.num_parameters()}
    sample = None
    if trainer.dist.main and cfg.sample_tokens:
        sample = write_sample(trainer)
        summary["sample"] = sample
    if trainer.dist.main:
        write_json(trainer.out / "result.json", summary)
        print_summary(trainer, summary)
    return summary


def write_sample(trainer: Trainer) -> str:
    from txl.generate import stream_tokens

    vocab = trainer.corpus.vocab
    prompt = list(vocab.encode(trainer.cfg.sample_prompt)) if trainer.cfg.sample_prompt else []
    if not prompt:
        prompt = [int(t) for t in trainer.corpus.split("valid")[:64]]
    generator = torch.Generator().manual_seed(trainer.cfg.seed)
    tokens = list(stream_tokens(trainer.model, prompt, max_new_tokens=trainer.cfg.sample_tokens,
                                temperature=0.8, top_k=40, generator=generator))
    text = vocab.decode(prompt + tokens)
    write_text(trainer.out / "sample.txt", text)  # atomic, and never through a link (txl.rundir)
    return text


def print_summary(trainer: Trainer, summary: dict) -> None:
    metric = summary["metric"]
    cap = trainer.cfg.eval_max_tokens
    print(f"\nrun: {trainer.out}  ({summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens']:,} tokens, {summary['tokens_per_second']:,.0f} tokens/s, stopped by "
          f"{summary['stopped_by']})")
    print(f"\n| split | {metric} | loss (nats) | tokens scored |\n|---|---|---|---|")
    for split, r in summary["final"].items():
        print(f"| {split} | {r[metric]:.4f} | {r['loss']:.4f} | {r['tokens']:,} |")
    if cap:
        print(f"(scored on the first {cap:,} tokens of each split; train.eval_max_tokens=0 scores them whole)")
    if summary.get("sample") is not None:
        print("\nsample:\n" + summary["sample"] + "\n")

