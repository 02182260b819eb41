"""After training: final scores with the best weights, a sample, result.json and a summary.

What it reads of a run is `FinishingRun` (the `Trainer` has it): no import of the trainer's module.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from txl.data.display import for_stream, json_text
from txl.errors import ConfigError, DataError
from txl.eval.result import metric_value
from txl.io import write_text
from txl.models.pretrained import read_json, write_json
from txl.models.registry import load_model
from txl.train.rundir import BEST, LAST
from txl.train.state import STATE_FILE


class FinishingRun(Protocol):
    """What the end of a run reads of it."""

    out: Path
    cfg: object  # txl.train.config.TrainConfig
    dist: object  # txl.train.distributed.Dist
    model: torch.nn.Module
    corpus: object
    metric: str
    objective: object  # txl.train.objectives.LanguageModelling or a subclass
    average: object | None  # txl.train.averaging.WeightAverage
    validates: bool
    sample_prompt: list[int]
    progress: object  # txl.train.checkpoint.Progress (its step)
    best_score: tuple[int, object] | None  # (step, EvalResult) of valid when this session saved `best`
    last_scores: dict[str, tuple[int, object]]  # the last validation's (step, EvalResult) per weights

    def evaluate_split(self, split: str, *, max_tokens: int = 0, progress: bool = False): ...


def sample_prompt_ids(corpus, cfg) -> list[int]:
    """The end-of-run sample's prompt, checked before the first step.

    A prompt the user set must encode with the corpus's vocabulary, word by word (an unknown word is
    not silently replaced by `<unk>`). Without one, the prompt is the corpus's own text: the first
    line of the valid split (else of train), at most 64 tokens, so every corpus has a prompt it can read.
    """
    if not cfg.sample_tokens:
        return []
    vocab = corpus.vocab
    if cfg.sample_prompt:
        why = ""
        try:
            ids = [int(i) for i in vocab.encode(cfg.sample_prompt)]
        except DataError as err:
            ids, why = [], str(err)
        if not why and vocab.kind == "words" and vocab.unk is not None:
            unknown = [w for w in cfg.sample_prompt.split() if w not in vocab.stoi]
            if unknown:
                why = f"word {unknown[0]!r} is not in the vocabulary (it would become {vocab.unk})"
        if not why and not ids:
            why = "it encodes to no tokens"
        if why:
            raise ConfigError(f"train.sample_prompt {cfg.sample_prompt!r} does not fit the corpus {cfg.data!r}: {why}; "
                              "set another with --set sample_prompt=TEXT or --set sample_prompt= (empty: the "
                              "start of the valid split)")
        return ids
    split = "valid" if "valid" in corpus.splits else "train"
    head = [int(t) for t in corpus.split(split)[:64]]
    newline = vocab.eos_id if vocab.eos_id is not None else _newline_id(vocab)
    if newline is not None and newline in head[:-1]:
        head = head[: head.index(newline) + 1]  # one whole line, ending at its boundary
    return head or [newline if newline is not None else 0]


def _newline_id(vocab) -> int | None:
    try:
        ids = vocab.encode("\n")
    except DataError:
        return None
    return int(ids[0]) if len(ids) == 1 else None


def final_cap(cfg) -> int:
    """Tokens scored per final split: final_max_tokens, else eval_max_tokens (0 = the whole split)."""
    return cfg.eval_max_tokens if cfg.final_max_tokens is None else cfg.final_max_tokens


def finish(trainer: FinishingRun, summary: dict) -> dict:
    """Evaluate the final splits with the best weights; write result.json (before the sample, so a
    failing sample cannot lose the scores), then the sample; print a summary and the next commands."""
    cfg = trainer.cfg
    results, live_results = {}, {}
    best_weights = live = None
    if trainer.dist.world > 1:
        dist.barrier()  # rank 0 has finished writing `best`
    if (trainer.out / BEST).is_dir():
        if trainer.average is not None:  # the last step's own weights, to score next to their average
            live = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        best = load_model(trainer.out / BEST, map_location=trainer.dist.device)
        trainer.model.load_state_dict(best.state_dict())
        if trainer.average is not None:  # which weights won on valid: the live ones or their average
            state = read_json(trainer.out / BEST / STATE_FILE, "best checkpoint state", follow_links=False)
            best_weights = state.get("weights") if isinstance(state, dict) else None
    # the same weights on the same tokens are not scored twice: `best` saved by this session was scored on
    # valid's first eval_max_tokens tokens when it was saved; a final cap of as many tokens reuses that score
    same_tokens = final_cap(cfg) == cfg.eval_max_tokens
    reused = {}
    for split in cfg.final_splits:
        if split not in trainer.corpus.splits:
            continue
        if split == "valid" and same_tokens and trainer.best_score is not None and (trainer.out / BEST).is_dir():
            reused[split], result = trainer.best_score
        else:
            result = trainer.evaluate_split(split, max_tokens=final_cap(cfg), progress=True)
        results[split] = result.to_dict()
        if trainer.dist.main:  # a sequence-to-sequence run's decoding scores
            results[split].update(trainer.objective.final_extras(trainer.model, split))
    if best_weights == "average" and live is not None and results:
        # what the average bought: the same splits scored with the live weights of the last step (reported
        # beside the best weights' scores, never chosen by them)
        trainer.model.load_state_dict(live)
        last_live = trainer.last_scores.get("live")
        for split in results:
            if split == "valid" and same_tokens and last_live is not None and last_live[0] == trainer.progress.step:
                live_results[split] = last_live[1].to_dict()  # the last step's validation of these weights
            else:
                live_results[split] = trainer.evaluate_split(split, max_tokens=final_cap(cfg)).to_dict()
        trainer.model.load_state_dict(best.state_dict())  # the sample comes from `best`
    best_valid = summary.pop("best_valid", math.inf)
    metric = trainer.metric
    summary = {**summary, "final": results, "metric": metric, "parameters": trainer.model.num_parameters(),
               "best_valid_loss_nats": best_valid if math.isfinite(best_valid) else None,
               f"best_valid_{metric}": metric_value(best_valid, metric) if math.isfinite(best_valid) else None,
               "data": cfg.data, "out": str(trainer.out.absolute())}
    if best_weights is not None:
        summary["best_weights"] = best_weights
    if reused:
        summary["final_from_validation"] = reused  # split -> the step whose validation gave its score
    if live_results:
        summary["final_live"] = live_results
    if not trainer.validates:
        summary["note"] = "the corpus has no valid split: validation was off"
    if trainer.dist.main:
        write_json(trainer.out / "result.json", summary)
        if cfg.sample_tokens and trainer.objective.writes_sample:
            text, ids = write_sample(trainer)
            summary["sample"] = json_text(text)  # valid UTF-8: undecodable bytes as \xNN escapes
            summary["sample_ids"] = ids
            write_json(trainer.out / "result.json", summary)
            summary["sample_text"] = text
        print_summary(trainer, summary)
    return summary


def write_sample(trainer: FinishingRun) -> tuple[str, list[int]]:
    """Continue the checked prompt; write the exact text to sample.txt. Returns (text, token ids)."""
    from txl.generate.decoder import stream_tokens

    vocab = trainer.corpus.vocab
    prompt = trainer.sample_prompt
    generator = torch.Generator().manual_seed(trainer.cfg.seed)
    tokens = list(stream_tokens(trainer.model, prompt, max_new_tokens=trainer.cfg.sample_tokens,
                                temperature=0.8, top_k=40, generator=generator))
    text = vocab.decode(prompt + tokens)
    write_text(trainer.out / "sample.txt", text)  # atomic, and never through a link (txl.io)
    return text, prompt + tokens


def print_summary(trainer: FinishingRun, summary: dict) -> None:
    metric = summary["metric"]
    cap = final_cap(trainer.cfg)
    out = trainer.out
    print(f"\nrun: {out}  ({summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens']:,} tokens, {summary['tokens_per_second']:,.0f} tokens/s, stopped by "
          f"{summary['stopped_by']})")
    if summary["final"] and trainer.objective.name == "mlm":  # masked LM: scores of the masked tokens
        print(f"\n| split | {metric} (masked) | loss (nats) | masked-token accuracy | tokens scored |\n"
              "|---|---|---|---|---|")
        for split, r in summary["final"].items():
            print(f"| {split} | {r[metric]:.4f} | {r['loss']:.4f} | {r['accuracy']:.4f} | {r['tokens']:,} |")
    elif summary["final"]:
        print(f"\n| split | {metric} | loss (nats) | tokens scored |\n|---|---|---|---|")
        for split, r in summary["final"].items():
            print(f"| {split} | {r[metric]:.4f} | {r['loss']:.4f} | {r['tokens']:,} |")
        classified = [(split, r["classification"]) for split, r in summary["final"].items() if "classification" in r]
        if classified:  # a classifier (issue 47): its scores per split
            print("\n| split | accuracy | macro-F1 | documents |\n|---|---|---|---|")
            for split, c in classified:
                print(f"| {split} | {c['accuracy']:.4f} | {c['macro_f1']:.4f} | {c['documents']:,} |")
        decoded = [(split, d) for split, r in summary["final"].items() for d in r.get("decoded", [])]
        if decoded:
            print("\n| split | decoding | exact match | ROUGE-1 | ROUGE-2 | ROUGE-L | token accuracy | pairs |\n"
                  "|---|---|---|---|---|---|---|---|")
            for split, d in decoded:
                rouge = " | ".join(f"{100 * d[k]:.2f}" if k in d else "-" for k in ("rouge1", "rouge2", "rougeL"))
                accuracy = summary["final"][split].get("token_accuracy")
                print(f"| {split} | {d['method']} | {100 * d['exact_match']:.2f}% | {rouge} | "
                      f"{100 * accuracy:.2f}% | {d['pairs']:,} |")
        if summary.get("best_weights") == "average":
            live = ", ".join(f"{split} {r[metric]:.4f}" for split, r in summary.get("final_live", {}).items())
            print("(best weights: the weight average, train.ema, scored better on valid than the live weights"
                  + (f"; the last step's live weights score {live})" if live else ")"))
        for split, step in summary.get("final_from_validation", {}).items():
            print(f"({split}: the score of the validation at step {step}, which chose these weights; the same weights "
                  "on the same tokens are not scored again)")
        if cap:
            print(f"(scored on the first {cap:,} tokens of each split; train.final_max_tokens=0 scores them whole)")
    elif not trainer.validates:
        print("\n(no valid split: validation was off and there is no final score)")
    if summary.get("sample_text") is not None:
        print("\nsample:\n" + for_stream(summary["sample_text"], sys.stdout) + "\n")
    weights = out / BEST if (out / BEST).is_dir() else out / LAST
    print(f"\nwritten: {out / 'result.json'} (scores), {weights} (weights), {out / LAST} (resumable), "
          f"{out / 'metrics.jsonl'} (curves)" + (f", {out / 'sample.txt'}" if summary.get("sample_text") else ""))
    steps = trainer.objective.next_commands(shlex.quote(str(out)))
    width = max(len(command) for command, _ in steps)
    print("next:\n" + "\n".join(f"  {command.ljust(width)}  # {what}" for command, what in steps))
