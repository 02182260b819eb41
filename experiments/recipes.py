"""The recipe search behind the CPU-hour presets (issue 23; the current result is docs/results/cpu_hour.md).

    python experiments/recipes.py --sweep ptb-word --minutes 10 [--data ptb-word:DIR]
    python experiments/recipes.py --sweep ptb-word --confirm NAME --seeds 2 --archive docs/results/archive/cpu_hour.json

An experiment, not part of the installed package: every run is an ordinary `txl train` process and the
report is read from the run directories, so it runs from any directory of a checkout with txl installed.

A sweep is a centre recipe (every swept key set explicitly, on top of a base preset that supplies the
corpus and the evaluation settings) and candidates that each change a few of its keys: model width
and depth, batch and tokens per step, tgt_len and mem_len, learning rate and warm-up, dropout, weight
decay. Every candidate is one ordinary `txl train` run in its own process (its command is in the
table), cut by `--minutes` of wall clock with a cosine schedule that follows those minutes (so every
proxy run ends its schedule, whatever its speed), then scored once on the whole valid split with its
best weights. Short proxy runs rank the candidates; `--confirm NAME` then trains one candidate for the
full budget with `--seeds` seeds and scores valid and test whole.

The budget is time, so a cheaper recipe takes more steps: that is the point (the best model for the
compute). Runs side by side share the machine: `--jobs` × `--threads` should not exceed its cores,
and nothing else should run meanwhile. Finished runs with the same command are reused (an
interrupted sweep continues where it stopped); `--fresh` retrains.

Writes recipes_<sweep>.json/.md/.png (or confirm_<sweep>_<candidate>.*) to `--out`; `--archive FILE` also
adds the report to the study's one archive JSON (docs/results/archive/cpu_hour.json holds every sweep and
confirmation so far), and `--render STEM` writes a report's .md and .png back from that archive.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from campaign import RESULTS, planned_run, read_record, read_records, script_main, train_variants

from txl.argtypes import integer, real, threads
from txl.errors import TxlError, UsageError
from txl.io import read_json, save_figure, write_text

ARCHIVE = RESULTS / "archive" / "cpu_hour.json"  # every report of this study so far
ARCHIVE_LIMIT = 64 << 20  # the archive holds every report of the study (about 1 MB today)


@dataclass(frozen=True)
class Candidate:
    name: str
    sets: tuple[str, ...]  # changes to the centre recipe (full keys: model.x=..., train.y=...)
    about: str


@dataclass(frozen=True)
class Sweep:
    preset: str  # supplies the corpus, evaluation settings and every key the sweep does not set
    centre: tuple[str, ...]  # the recipe every candidate starts from
    candidates: tuple[Candidate, ...]
    about: str
    recipe: str  # the candidate the preset trains (its keys on the centre give the preset's own config)


# Each candidate's comment says why it was tried (often what the one before it showed); what it gave, with
# its command and report, is in docs/results/cpu_hour.md, the one place the results are stated.

# Proxy runs validate once at the end on the whole valid split and write no sample.
PROXY_SETS = ("train.eval_interval=1000000000", "train.eval_max_tokens=0", "train.final_splits=[]",
              "train.sample_tokens=0", "train.log_interval=25")
# Confirmations: validation every few minutes' worth of steps on a slice, the final splits whole.
CONFIRM_SETS = ('train.final_splits=["valid", "test"]', "train.final_max_tokens=0")

# ptb-char-hour's shape (the `small` candidate), shared by the candidates that vary it
SMALL = ("model.n_layer=4", "model.d_model=192", "model.n_head=3", "model.d_inner=768")
# ptb-word-hour's recipe (deep-roll-varlen-lr-1e-3) as changes to the ptb-word sweep's centre
DEEP_ROLL = ("model.n_layer=6", "train.roll=true", "train.varlen=true", "train.lr=1e-3")
DEEP_ROLL_ABOUT = "6 × 256, per-epoch roll, variable segment length, learning rate 1e-3"
# a ptb-word-hour lead, which the weight-decay candidates build on
DEEP_ROLL_DROPOUT_02_EMA = (*DEEP_ROLL, "model.dropout=0.2", "train.ema=0.999")
DEEP_ROLL_DROPOUT_02_EMA_ABOUT = f"{DEEP_ROLL_ABOUT}, dropout 0.2, EMA of the weights 0.999"
# the decay the dropout-0.1 candidates trade dropout for (weight decay 0.3 held valid level with 0.1)
ADAMW_WD_03 = ("train.optimizer=adamw", "train.weight_decay=0.3")
# a later ptb-word-hour recipe (deep-roll-varlen-dropout-0.1-ema-wd-0.3), which later candidates build on
DROPOUT_01_EMA_WD_03 = (*DEEP_ROLL_DROPOUT_02_EMA, "model.dropout=0.1", *ADAMW_WD_03)
DROPOUT_01_EMA_WD_03_ABOUT = f"{DEEP_ROLL_ABOUT}, dropout 0.1, EMA of the weights 0.999, AdamW weight decay 0.3"
# batch 16 (deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16); ptb-word-hour adds train.eval_live=false and
# model.d_inner=2048 to it
BATCH_16 = (*DROPOUT_01_EMA_WD_03, "train.batch_size=16", "train.ema=0.9995")
BATCH_16_ABOUT = f"{DEEP_ROLL_ABOUT}, dropout 0.1, AdamW weight decay 0.3, batch 16, EMA of the weights 0.9995"

SWEEPS: dict[str, Sweep] = {
    "ptb-char": Sweep(
        preset="ptb-char-hour",
        centre=("model.n_layer=6", "model.d_model=256", "model.n_head=4", "model.d_head=64", "model.d_inner=1024",
                "model.dropout=0.1", "model.dropatt=0.0", "model.mem_len=128", "train.tgt_len=128",
                "train.batch_size=16", "train.lr=1e-3", "train.warmup_steps=200", "train.weight_decay=0",
                "train.optimizer=adam", "train.schedule=cosine", "train.precision=auto"),
        candidates=(
            Candidate("centre", (), "the centre recipe: 6 × 256, tgt = mem = 128, batch 16, lr 1e-3, bf16 where fast"),
            Candidate("fp32", ("train.precision=fp32",), "the centre in fp32"),
            Candidate("bf16", ("train.precision=bf16",), "the centre in bf16 autocast (fp32 master weights)"),
            Candidate("lr-2e-3", ("train.lr=2e-3",), "learning rate 2e-3"),
            Candidate("lr-5e-4", ("train.lr=5e-4",), "learning rate 5e-4"),
            Candidate("mem-0", ("model.mem_len=0",), "no memory (does the memory pay for itself at this budget?)"),
            Candidate("mem-256", ("model.mem_len=256",), "memory 256"),
            Candidate("tgt-256", ("train.tgt_len=256", "train.batch_size=8"), "segments of 256, batch 8 (same tokens per step)"),
            Candidate("batch-32", ("train.batch_size=32",), "batch 32 (twice the tokens per step)"),
            Candidate("batch-8", ("train.batch_size=8",), "batch 8 (half the tokens per step)"),
            Candidate("narrow-deep", ("model.n_layer=8", "model.d_model=192", "model.n_head=3", "model.d_inner=768"),
                      "8 × 192 (about the same parameters)"),
            Candidate("wide-shallow", ("model.n_layer=4", "model.d_model=320", "model.n_head=5", "model.d_inner=1280"),
                      "4 × 320 (about the same parameters)"),
            Candidate("small", SMALL,
                      "4 × 192 (fewer parameters, more steps)"),
            Candidate("small-fp32", (*SMALL, "train.precision=fp32"), "4 × 192 (ptb-char-hour's shape) in fp32"),
            Candidate("small-bf16", (*SMALL, "train.precision=bf16"),
                      "4 × 192 (ptb-char-hour's shape) in bf16 autocast (fp32 master weights)"),
            Candidate("small-dropout-0", (*SMALL, "model.dropout=0.0"),
                      "4 × 192 without dropout (the hour's small model did not overfit in 7 epochs)"),
            Candidate("large", ("model.n_layer=8", "model.d_model=320", "model.n_head=5", "model.d_inner=1280"),
                      "8 × 320 (more parameters, fewer steps)"),
            Candidate("dropout-0", ("model.dropout=0.0",), "no dropout"),
            Candidate("dropout-0.2", ("model.dropout=0.2",), "dropout 0.2"),
            Candidate("wd-0.01", ("train.optimizer=adamw", "train.weight_decay=0.01"), "AdamW, weight decay 0.01"),
            Candidate("muon", ("train.optimizer=muon",), "Muon on the hidden matrices, AdamW on the rest"),
            Candidate("small-muon", (*SMALL, "train.optimizer=muon"), "4 × 192 (ptb-char-hour's shape) with Muon"),
            Candidate("small-muon-lr-2e-3", (*SMALL, "train.optimizer=muon", "train.lr=2e-3"),
                      "4 × 192 with Muon, learning rate 2e-3"),
        ),
        about="Penn Treebank characters (test bpc; AWD-LSTM 1.175 after GPU-days)",
        recipe="small-dropout-0",
    ),
    "ptb-word": Sweep(
        preset="ptb-word-hour",
        centre=("model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.d_head=64", "model.d_inner=1024",
                "model.dropout=0.3", "model.dropatt=0.1", "model.mem_len=70", "train.tgt_len=70",
                "train.batch_size=32", "train.lr=5e-4", "train.warmup_steps=300", "train.weight_decay=0",
                "train.optimizer=adam", "train.schedule=cosine", "train.precision=auto",
                # the preset turns these on (deep-roll-varlen-lr-1e-3 won); the centre keeps the old order
                "train.roll=false", "train.varlen=false",
                # and this (deep-roll-varlen-dropout-0.1-ema-wd-0.3 won); candidates that average ask for it
                "train.ema=0",
                # and this (...-batch-16-eval-average): earlier candidates validated both weights every time
                "train.eval_live=true"),
        candidates=(
            Candidate("centre", (), "the centre recipe: ptb-word-small's shape, cosine over the minutes, bf16 where fast"),
            Candidate("lr-1e-3", ("train.lr=1e-3",), "learning rate 1e-3"),
            Candidate("lr-2e-3", ("train.lr=2e-3",), "learning rate 2e-3"),
            # a larger model at the learning rate that won (lr-1e-3): does capacity pay inside the hour?
            Candidate("deep-lr-1e-3", ("model.n_layer=6", "train.lr=1e-3"), "6 × 256, learning rate 1e-3"),
            Candidate("wide-lr-1e-3", ("model.d_model=384", "model.n_head=6", "model.d_inner=1536", "train.lr=1e-3"),
                      "4 × 384, learning rate 1e-3"),
            # 25 epochs in the hour see the same segments in the same order each time: roll each stream by a
            # random offset per epoch and vary the segment length (AWD-LSTM's variable BPTT) so they do not
            Candidate("roll-varlen-lr-1e-3", ("train.roll=true", "train.varlen=true", "train.lr=1e-3"),
                      "per-epoch random roll of each stream, variable segment length, learning rate 1e-3"),
            Candidate("deep-roll-varlen-lr-1e-3", DEEP_ROLL, DEEP_ROLL_ABOUT),
            # 6 layers beat 4 on one seed although they saw a third fewer tokens: does depth pay further?
            Candidate("deeper-roll-varlen-lr-1e-3", ("model.n_layer=8", "train.roll=true", "train.varlen=true",
                                                     "train.lr=1e-3"),
                      "8 × 256, per-epoch roll, variable segment length, learning rate 1e-3"),
            # the preset scores 37 on training text and 79.5 on valid (seed 1111): it overfits; more dropout?
            Candidate("deep-roll-varlen-dropout-0.4", (*DEEP_ROLL, "model.dropout=0.4"), f"{DEEP_ROLL_ABOUT}, dropout 0.4"),
            # dropout 0.4 trailed by 11 valid ppl at step 4,000 (seed 1111): does less regularisation learn faster?
            Candidate("deep-roll-varlen-dropout-0.2-ema", DEEP_ROLL_DROPOUT_02_EMA, DEEP_ROLL_DROPOUT_02_EMA_ABOUT),
            # the Transformer-XL paper averages the weights on Penn Treebank: `best` is the EMA when it wins
            Candidate("deep-roll-varlen-ema", (*DEEP_ROLL, "train.ema=0.999"), f"{DEEP_ROLL_ABOUT}, EMA of the weights 0.999"),
            # dropout 0.2 overfits at the end (train ppl 41.7, valid flat over the last 900 steps): decoupled weight
            # decay regularises without slowing the early learning the way more dropout does
            Candidate("deep-roll-varlen-dropout-0.2-ema-wd-0.1",
                      (*DEEP_ROLL_DROPOUT_02_EMA, "train.optimizer=adamw", "train.weight_decay=0.1"),
                      f"{DEEP_ROLL_DROPOUT_02_EMA_ABOUT}, AdamW weight decay 0.1"),
            # weight decay 0.1 gained 2 valid ppl over dropout 0.2 alone and valid was still flat at the end: more?
            Candidate("deep-roll-varlen-dropout-0.2-ema-wd-0.3",
                      (*DEEP_ROLL_DROPOUT_02_EMA, *ADAMW_WD_03),
                      f"{DEEP_ROLL_DROPOUT_02_EMA_ABOUT}, AdamW weight decay 0.3"),
            # decay 0.3 held valid level with 0.1 while training ppl rose 39.3 -> 43.6: it regularises on its own, so
            # trade dropout (which slows the early learning) for it
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3", DROPOUT_01_EMA_WD_03, DROPOUT_01_EMA_WD_03_ABOUT),
            # dropout 0.1 led until step 4,000 (average 75.42 against 77.36 at 0.2), then overfitted (training ppl 28,
            # the average 76.06 / 77.21 at steps 5k / 6k): late dropout, 0.1 rising to 0.3 over the hour
            Candidate("deep-roll-varlen-dropout-0.1-to-0.3-ema-wd-0.3",
                      (*DEEP_ROLL_DROPOUT_02_EMA, "model.dropout=0.3", "train.dropout_start=0.1", *ADAMW_WD_03),
                      f"{DEEP_ROLL_ABOUT}, dropout rising 0.1 -> 0.3 over the run, EMA of the weights 0.999, "
                      "AdamW weight decay 0.3"),
            # 0.1 -> 0.3 stalled the training ppl at 51-54 from step 4,000 (test 73.08, a slow hour): rise only to 0.2,
            # where constant dropout still learned at the end of the cosine
            Candidate("deep-roll-varlen-dropout-0.1-to-0.2-ema-wd-0.3",
                      (*DEEP_ROLL_DROPOUT_02_EMA, "train.dropout_start=0.1", *ADAMW_WD_03),
                      f"{DEEP_ROLL_ABOUT}, dropout rising 0.1 -> 0.2 over the run, EMA of the weights 0.999, "
                      "AdamW weight decay 0.3"),
            # 0.1 -> 0.2 ended without overfitting (its last weights 71.36) but peaked no better than constant 0.1
            # (71.19 against 70.72 / 71.39): the rate between them, held constant
            Candidate("deep-roll-varlen-dropout-0.15-ema-wd-0.3",
                      (*DEEP_ROLL_DROPOUT_02_EMA, "model.dropout=0.15", *ADAMW_WD_03),
                      f"{DEEP_ROLL_ABOUT}, dropout 0.15, EMA of the weights 0.999, AdamW weight decay 0.3"),
            # the tied 10k × 256 embedding is a third of the parameters and the model still memorises (training ppl 28
            # against valid 76 at the end): AWD-LSTM's whole-word dropout on top, leaving the body's dropout at 0.1
            Candidate("deep-roll-varlen-dropout-0.1-embed-0.1-ema-wd-0.3", (*DROPOUT_01_EMA_WD_03, "model.dropout_embed=0.1"),
                      f"{DROPOUT_01_EMA_WD_03_ABOUT}, whole-word dropout 0.1"),
            # every regulariser tried lands at valid 75.4-76.4: change the model's form instead. The reference
            # (kimiyoung's train.py) allows the adaptive softmax only on wt103 and lm1b and trains PTB with the full
            # one; the hour's presets took cutoff 2000 for speed, but this recipe peaks before the hour is spent
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-full-softmax", (*DROPOUT_01_EMA_WD_03, "model.cutoffs=[]"),
                      f"{DROPOUT_01_EMA_WD_03_ABOUT}, full softmax (no cutoff)"),
            # neither the softmax nor the eval's context (memory 70-200 gives the same valid) moves the peak: the
            # batch sets the gradient noise and the updates per token, which no run had varied at this shape. Batch 16
            # at the same learning rate, its average as long in tokens as batch 32's (ema 0.9995: 2,000 steps of
            # 1,120 tokens)
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16", BATCH_16, BATCH_16_ABOUT),
            # the same training, validated faster: batch 16's average led its live weights at every validation of
            # its three hours (by 0.17-14.7 valid ppl), and each whole-split pass of the live weights took about 9 s of every
            # 1,000 steps (about 2.5% of the hour); the live weights are scored at the last validation only
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16-eval-average", (*BATCH_16, "train.eval_live=false"),
                      f"{BATCH_16_ABOUT}, the live weights validated only at the end"),
            # every regulariser tried moves the peak in time, not in height (dropout 0.1-0.2, weight decay 0.1-0.3: valid
            # 74.5-76.4), while more updates per token (batch 16) lowered it: the hour is bound by what the model learns
            # per token. A wider feed-forward layer buys that almost free in time under bf16 (short interleaved runs:
            # docs/results/cpu_hour.md), 3.2M parameters more. ptb-word-hour's recipe
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16-eval-average-ff-2048",
                      (*BATCH_16, "train.eval_live=false", "model.d_inner=2048"),
                      f"{BATCH_16_ABOUT}, the live weights validated only at the end, feed-forward 2048"),
            # the tied 10k x 256 embedding is a third of the parameters, and 8,000 of its rows are words seen 49 times
            # or fewer in train (median 11; 14% of the tokens): the adaptive input and softmax of Baevski & Auli
            # (the reference's wt103 div_val 4) give those rows 64 dimensions projected to 256, 1.5M parameters
            # fewer, and a cheaper tail softmax
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16-div-4", (*BATCH_16, "model.div_val=4"),
                      f"{BATCH_16_ABOUT}, adaptive input and softmax (div_val 4)"),
            # batch 32 -> 16 lowered the average's peak (valid 75.42 / 76.35 -> 74.91 / 75.95) and learned more per
            # token; halve it again, the average again as long in tokens (0.99975: 4,000 steps of 560 tokens)
            Candidate("deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-8",
                      (*DROPOUT_01_EMA_WD_03, "train.batch_size=8", "train.ema=0.99975"),
                      f"{DEEP_ROLL_ABOUT}, dropout 0.1, AdamW weight decay 0.3, batch 8, EMA of the weights 0.99975"),
            Candidate("deep-roll-varlen-dropout-0.4-ema", (*DEEP_ROLL, "model.dropout=0.4", "train.ema=0.999"),
                      f"{DEEP_ROLL_ABOUT}, dropout 0.4, EMA of the weights 0.999"),
            Candidate("lr-2.5e-4", ("train.lr=2.5e-4",), "learning rate 2.5e-4"),
            Candidate("dropout-0.4", ("model.dropout=0.4",), "dropout 0.4"),
            Candidate("dropout-0.5", ("model.dropout=0.5", "model.dropatt=0.2"), "dropout 0.5, attention dropout 0.2"),
            Candidate("dropout-0.2", ("model.dropout=0.2",), "dropout 0.2"),
            Candidate("mem-0", ("model.mem_len=0",), "no memory"),
            Candidate("mem-150", ("model.mem_len=150",), "memory 150"),
            Candidate("wide", ("model.d_model=384", "model.n_head=6", "model.d_inner=1536"), "4 × 384"),
            Candidate("deep", ("model.n_layer=6",), "6 × 256"),
            Candidate("batch-16", ("train.batch_size=16",), "batch 16"),
            Candidate("wd-0.1", ("train.optimizer=adamw", "train.weight_decay=0.1"), "AdamW, weight decay 0.1"),
            Candidate("muon", ("train.optimizer=muon",), "Muon on the hidden matrices, AdamW on the rest"),
            # AWD-LSTM's word-level regularisers in the decoder (txl/nn/regularization.py); the paper trains
            # its PTB model with variational dropout
            Candidate("embed-0.1", ("model.dropout_embed=0.1",), "whole-word dropout 0.1"),
            Candidate("input-0.4", ("model.dropout_input=0.4",), "locked (variational) dropout 0.4 on the embeddings"),
            Candidate("embed-0.1-input-0.2", ("model.dropout_embed=0.1", "model.dropout_input=0.2"),
                      "between centre and awd: whole-word dropout 0.1, locked embedding dropout 0.2, dropout 0.3"),
            Candidate("awd", ("model.dropout_embed=0.1", "model.dropout_input=0.4", "model.dropout=0.4"),
                      "whole-word dropout 0.1, locked embedding dropout 0.4, dropout 0.4"),
            Candidate("awd-wide", ("model.dropout_embed=0.1", "model.dropout_input=0.5", "model.dropout=0.5",
                                   "model.d_model=384", "model.n_head=6", "model.d_inner=1536"),
                      "4 × 384, whole-word dropout 0.1, locked embedding dropout 0.5, dropout 0.5"),
        ),
        about="Penn Treebank words, 10k vocabulary (test perplexity; Transformer-XL 54.5 after GPU-days)",
        recipe="deep-roll-varlen-dropout-0.1-ema-wd-0.3-batch-16-eval-average-ff-2048",
    ),
}


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # two jobs would train in one run directory
        raise argparse.ArgumentTypeError(f"candidate(s) named twice: {', '.join(twice)}")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default=None, help="which recipe sweep (required unless "
                        "--render)")
    parser.add_argument("--candidates", type=_names, default=(), metavar="LIST",
                        help="candidates to run (default all of the sweep)")
    parser.add_argument("--data", default=None, help="data spec (default: the preset's corpus from its download location)")
    parser.add_argument("--minutes", type=real(0, 7 * 24 * 60, low_open=True), default=None,
                        help="wall-clock budget of each run (default: 10 for the proxies, the preset's "
                             "max_minutes for --confirm)")
    parser.add_argument("--steps", type=integer(1, 100_000_000), default=None,
                        help="a step budget instead of minutes: every candidate trains the same steps (what a step "
                             "learns, e.g. bf16 against fp32), the cosine over those steps")
    parser.add_argument("--threads", type=threads(auto=False), default=1, help="torch threads per run (default 1)")
    parser.add_argument("--jobs", type=integer(1, 256), default=2, help="runs side by side (default 2)")
    parser.add_argument("--confirm", metavar="NAME", default=None,
                        help="train this candidate with --seeds seeds and score valid and test whole")
    parser.add_argument("--seeds", type=integer(1, 100), default=None,
                        help="seeds per candidate (default 1; --confirm: 2); the spread is reported next to the gaps")
    parser.add_argument("--runs", default="runs/recipes", help="directory of the run directories (default runs/recipes)")
    parser.add_argument("--out", default="runs/recipes/reports",
                        help="directory for the tables and plots (default runs/recipes/reports)")
    parser.add_argument("--archive", metavar="FILE", default=None,
                        help="also add the report to this archive JSON, keyed by its name (the study's: "
                             "docs/results/archive/cpu_hour.json)")
    parser.add_argument("--render", metavar="STEM", default=None,
                        help="train nothing: write STEM.md and STEM.png to --out from the report STEM of --archive "
                             "(default the study's archive)")
    parser.add_argument("--fresh", action="store_true", help="retrain runs that already finished")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override for every run (after the candidate's keys)")


def command(sweep: Sweep, candidate: Candidate, args: argparse.Namespace, *, run_name: str,
            seed: int | None = None, confirm: bool = False) -> list[str]:
    argv = ["txl", "train", "--preset", sweep.preset]
    if args.data:
        argv += ["--data", args.data]
    if args.steps:  # the same steps for everyone; the schedule over them
        argv += ["--max-steps", str(args.steps), "--set", "train.max_minutes=0"]
    else:  # the same minutes; the schedule over them
        argv += ["--max-minutes", f"{args.minutes:g}", "--set", "train.max_steps=1000000000", "--set",
                 "train.schedule_clock=minutes"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    for s in (*(CONFIRM_SETS if confirm else PROXY_SETS), *sweep.centre, *candidate.sets, *args.sets):
        argv += ["--set", s]
    argv += ["--out", str(Path(args.runs) / run_name)]
    return argv


def plan_item(sweep: Sweep, candidate: Candidate, args: argparse.Namespace, *, run_name: str,
              seed: int | None = None, confirm: bool = False) -> dict:
    argv = command(sweep, candidate, args, run_name=run_name, seed=seed, confirm=confirm)
    return planned_run(argv, Path(args.runs) / run_name, threads=args.threads, fresh=args.fresh,
                       name=candidate.name, about=candidate.about, changes=list(candidate.sets), seed=seed)


def collect(item: dict) -> dict:
    """One finished run: its final scores, speed and training curve (minutes, train and valid metric)."""
    run_dir = Path(item["run_dir"])
    result = read_record(run_dir / "result.json")
    records = read_records(run_dir / "metrics.jsonl")
    metric = result.get("metric", "bpc")
    final = {split: scores[metric] for split, scores in (result.get("final") or {}).items()}
    valid = [r for r in records if r.get("split") == "valid"]
    return {
        **{k: item[k] for k in ("name", "about", "changes", "command", "peak_rss_mb", "seed")},
        "metric": metric,
        "parameters": result["parameters"],
        "steps": result["steps"],
        "tokens": result["tokens"],
        "train_minutes": result["elapsed"] / 60,
        "tokens_per_second": result["tokens_per_second"],
        "precision": read_record(run_dir / "run.json").get("precision"),
        "valid": final.get("valid", valid[-1][metric] if valid else None),
        "test": final.get("test"),
        "best_weights": result.get("best_weights"),  # "average" when train.ema's average won on valid
        # then the last step's live weights, scored beside it
        "test_live": ((result.get("final_live") or {}).get("test") or {}).get(metric),
        # a record without a finite value holds null (train/loop.py): no point on the curves
        "curve": [(r["elapsed"] / 60, r[metric]) for r in records
                  if r.get("split") == "train" and r.get(metric) is not None],
        "valid_curve": [(r["elapsed"] / 60, r[metric]) for r in valid if r.get(metric) is not None],
        # train.ema's weight average, validated beside the live weights
        "valid_ema_curve": [(r["elapsed"] / 60, r[metric]) for r in records
                            if r.get("split") == "valid_ema" and r.get(metric) is not None],
    }


def budget_words(report: dict) -> tuple[str, str]:
    """(short, long) descriptions of the runs' budget: minutes of wall clock, or steps."""
    if report.get("steps"):
        return f"{report['steps']:,}-step", f"{report['steps']:,} steps (the cosine schedule over them)"
    return (f"{report['minutes']:g}-minute",
            f"{report['minutes']:g} minutes of training wall clock (the cosine schedule follows the minutes)")


def seed_summary(rows: list[dict], key: str = "valid") -> list[dict]:
    """Per candidate: its seeds' values of `key`, their mean and sample standard deviation."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    out = []
    for name in names:
        values = [r[key] for r in rows if r["name"] == name and r[key] is not None]
        if values:
            out.append({"name": name, "values": values, "mean": statistics.mean(values),
                        "sd": statistics.stdev(values) if len(values) > 1 else None})
    return out


def markdown(report: dict) -> str:
    from txl.bench.common import machine_markdown

    rows, metric = report["rows"], report["rows"][0]["metric"] if report["rows"] else "bpc"
    confirm = report.get("confirm")
    short, long = budget_words(report)
    title = (f"# Confirmation: `{confirm}` of the {report['sweep']} sweep, {short} runs, {len(rows)} seed(s)"
             if confirm else f"# Recipe sweep: {report['sweep']}, {short} proxies")
    lines = [
        title, "",
        f"Written by `python experiments/recipes.py`. {report['about']}. Every row is one `txl train "
        f"--preset {report['preset']}` run with the centre recipe and the row's changes, for {long}, "
        f"{report['threads']} torch thread(s), {report['jobs']} run(s) side by side, then scored with its best weights "
        "on the whole split(s).", "",
        f"Centre recipe: `{' '.join(report['centre'])}`", "",
        machine_markdown({**report["machine"], "threads": f"{report['threads']} (per run)"}), "",
    ]
    if confirm:
        lines += [f"| seed | params | steps | tokens | tokens/s | precision | valid {metric} | test {metric} | peak RSS (MB) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['seed']} | {r['parameters']:,} | {r['steps']:,} | {r['tokens']:,} | "
                         f"{r['tokens_per_second']:,.0f} | {r['precision']} | {r['valid']:.4f} | {r['test']:.4f} | "
                         f"{r['peak_rss_mb']:,.0f} |")
        tests = [r["test"] for r in rows]
        spread = f" ± {statistics.stdev(tests):.4f} (sample sd)" if len(tests) > 1 else ""
        lines += ["", f"Test {metric}: {', '.join(f'{t:.4f}' for t in tests)}; mean {statistics.mean(tests):.4f}{spread}."]
        for r in rows:
            if r.get("best_weights") == "average":  # train.ema: say what the average bought
                live = f"; the last step's live weights: test {r['test_live']:.4f}" if r.get("test_live") else ""
                lines += ["", f"Seed {r['seed']}: `best` is the weight average (train.ema), which scored better on "
                              f"valid than the live weights{live}."]
    else:
        lines += [f"| candidate | seed | changes | params | steps | tokens (M) | tokens/s | precision | valid {metric} | "
                  "peak RSS (MB) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["valid"] is None, r["valid"] or 0)):
            changes = " ".join(f"`{c}`" for c in r["changes"]) or "—"
            lines.append(f"| {r['name']} | {r['seed'] or 'preset'} | {changes} | {r['parameters']:,} | {r['steps']:,} | "
                         f"{r['tokens'] / 1e6:.2f} | {r['tokens_per_second']:,.0f} | {r['precision']} | "
                         f"{r['valid']:.4f} | {r['peak_rss_mb']:,.0f} |")
        summary = seed_summary(rows)
        if any(s["sd"] is not None for s in summary):
            # the reference is the centre when it ran, else the first candidate named (e.g. fp32 for small-bf16)
            reference = next((s for s in summary if s["name"] == "centre"), summary[0])
            ref = reference["name"]
            lines += ["", f"Over seeds (mean ± sample sd), and each candidate's gap to {ref} against the "
                          f"combined spread sqrt(sd² + sd_{ref}²):", "",
                      f"| candidate | valid {metric} per seed | mean ± sd | gap to {ref} | gap / spread |",
                      "|---|---|---|---|---|"]
            for s in sorted(summary, key=lambda s: s["mean"]):
                gap = ratio = "—"
                if s is not reference and s["sd"] is not None and reference["sd"] is not None:
                    spread = (s["sd"] ** 2 + reference["sd"] ** 2) ** 0.5
                    gap = f"{s['mean'] - reference['mean']:+.4f}"
                    ratio = f"{(s['mean'] - reference['mean']) / spread:+.1f}" if spread > 0 else "—"
                sd = f" ± {s['sd']:.4f}" if s["sd"] is not None else ""
                lines.append(f"| {s['name']} | {', '.join(f'{v:.4f}' for v in s['values'])} | {s['mean']:.4f}{sd} | "
                             f"{gap} | {ratio} |")
    lines += ["", f"![{metric} against minutes]({report['stem']}.png)", "", "## Reproduce", "", "```",
              *[r["command"] for r in rows], "```", "", f"All of it: `{report['reproduce']}`", ""]
    return "\n".join(lines)


def valid_ends(row: dict) -> list[float]:
    """Where a row's validation curves end (live weights, weight average): the plot's range holds them
    too, since word-level valid sits far above train."""
    return [curve[-1][1] for curve in (row["valid_curve"], row.get("valid_ema_curve") or []) if curve]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab20").colors
    metric = report["rows"][0]["metric"] if report["rows"] else "bpc"
    ends = []
    for index, r in enumerate(report["rows"]):
        label = f"seed {r['seed']}" if report.get("confirm") else r["name"] + (f" (seed {r['seed']})" if r["seed"] else "")
        if r["curve"]:
            xs, ys = zip(*r["curve"], strict=True)
            k = 8  # running mean over 8 log records
            smooth = [statistics.mean(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, color=colours[index % 20], label=f"{label} train ({r['valid']:.3f} valid)")
            ends.append(smooth[-1])
        if r["valid_curve"]:  # one point when train.eval_live=false: the live weights at the end
            xs, ys = zip(*r["valid_curve"], strict=True)
            ax.plot(xs, ys, color=colours[index % 20], linestyle="--", marker="o", markersize=3, label=f"{label} valid")
        if len(r.get("valid_ema_curve") or []) > 1:  # older reports have none
            xs, ys = zip(*r["valid_ema_curve"], strict=True)
            ax.plot(xs, ys, color=colours[index % 20], linestyle=":", marker="s", markersize=2,
                    label=f"{label} valid, weight average")
        ends += valid_ends(r)
    ax.set_xlabel("training minutes (wall clock)")
    ax.set_ylabel(f"{metric} (train: running mean)")
    ax.set_title(f"{report['sweep']}: " + ("confirmation runs" if report.get("confirm") else "recipe proxies"))
    if ends:
        ax.set_ylim(min(ends) - 0.15 * abs(min(ends)), max(ends) + 0.3 * abs(max(ends)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from txl.bench.common import machine
    from txl.train.config import build_run_config

    if args.render:
        return render(args)
    if args.sweep is None:
        raise UsageError("--sweep is required (ptb-char or ptb-word), or --render STEM")
    sweep = SWEEPS[args.sweep]
    if args.steps is not None and args.minutes is not None:
        raise UsageError("give --minutes or --steps, not both")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.minutes is None and not args.steps:
        args.minutes = build_run_config(preset=sweep.preset).train.max_minutes if args.confirm else 10.0
    if args.seeds is None:
        args.seeds = 2 if args.confirm else 1
    if (args.minutes is not None and args.minutes <= 0) or args.threads < 1 or args.jobs < 1 or args.seeds < 1:
        raise UsageError("--minutes must be > 0 and --threads, --jobs, --seeds >= 1")
    budget = f"{args.steps}steps" if args.steps else ""
    known = {c.name: c for c in sweep.candidates}
    wanted = (args.confirm,) if args.confirm else (args.candidates or tuple(known))
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise UsageError(f"unknown candidate(s) {', '.join(unknown)} of sweep {args.sweep}; known: {', '.join(known)}")
    first = build_run_config(preset=sweep.preset, sets=[*sweep.centre, *args.sets]).train.seed
    if args.confirm:
        plan = [plan_item(sweep, known[args.confirm], args, seed=first + k, confirm=True,
                          run_name=f"{args.sweep}-confirm-{args.confirm}{'-' + budget if budget else ''}-seed{first + k}")
                for k in range(args.seeds)]
    else:  # the first seed without --seed (its command as before); a step budget in its own directories
        plan = [plan_item(sweep, known[name], args, seed=first + k if k else None,
                          run_name="-".join([args.sweep, name, *([budget] if budget else []),
                                             *([f"seed{first + k}"] if k else [])]))
                for name in wanted for k in range(args.seeds)]
    started = time.time()
    train_variants(plan, args, desc=f"recipes {args.sweep}")
    flags = ["python", "experiments/recipes.py", "--sweep", args.sweep,
             *(["--steps", str(args.steps)] if args.steps else ["--minutes", f"{args.minutes:g}"]),
             "--threads", str(args.threads), "--jobs", str(args.jobs), "--seeds", str(args.seeds)]
    flags += ["--confirm", args.confirm] if args.confirm else (
        ["--candidates", ",".join(args.candidates)] if args.candidates else [])
    if args.data:
        flags += ["--data", args.data]
    for s in args.sets:
        flags += ["--set", s]
    stem = (f"confirm_{args.sweep}_{args.confirm}" if args.confirm else f"recipes_{args.sweep}") + (
        f"_{budget}" if budget else "")
    report = {"sweep": args.sweep, "preset": sweep.preset, "about": sweep.about, "centre": list(sweep.centre),
              "confirm": args.confirm, "minutes": args.minutes, "steps": args.steps, "seeds": args.seeds,
              "threads": args.threads, "jobs": args.jobs,
              "machine": machine(), "wall_minutes": (time.time() - started) / 60, "stem": stem,
              "reproduce": shlex.join(flags), "rows": [collect(item) for item in plan]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    if args.archive:
        archive = read_archive(Path(args.archive), missing_ok=True)
        archive["reports"][stem] = report
        write_text(Path(args.archive), json.dumps(archive, indent=1) + "\n")
    text = markdown(report)
    write_text(out / f"{stem}.md", text)
    plot(report, out / f"{stem}.png")
    print(text.split("## Reproduce")[0])
    print(f"wrote {out / stem}.md, .json, .png")
    return 0


def read_archive(path: Path, *, missing_ok: bool = False) -> dict:
    """The study's archive: {"about": ..., "reports": {stem: report}} (one JSON for every past run)."""
    if missing_ok and not path.exists():
        return {"about": "every report of experiments/recipes.py, keyed by its name (STEM.md/.png: --render STEM)",
                "reports": {}}
    try:
        archive = read_json(path, what="recipe archive", limit=ARCHIVE_LIMIT, error=UsageError)
    except (OSError, ValueError, TxlError) as err:
        raise UsageError(f"cannot read the archive {path} ({err}); pass --archive FILE") from None
    if not isinstance(archive, dict) or not isinstance(archive.get("reports"), dict):
        raise UsageError(f"{path} is not a recipe archive (no \"reports\" object); pass --archive FILE")
    return archive


def render(args: argparse.Namespace) -> int:
    """Write one archived report's .md and .png (the per-run pages are not kept in docs/)."""
    path = Path(args.archive) if args.archive else ARCHIVE
    reports = read_archive(path)["reports"]
    if args.render not in reports:
        raise UsageError(f"{path} holds no report {args.render!r}; it holds: {', '.join(sorted(reports))}")
    report = {**reports[args.render], "stem": Path(args.render).name}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"{report['stem']}.md", markdown(report))
    plot(report, out / f"{report['stem']}.png")
    print(f"wrote {out / report['stem']}.md, .png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return script_main("recipes", "the recipe search for the best model per CPU-hour: proxy runs of recipe "
                       "candidates, then seeded confirmations (docs/results/cpu_hour.md)", configure, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
