"""Device check (issue 46 item 6): what txl does on one CUDA GPU, measured in one run of under 8 minutes.

    bash scripts/device_check.sh OUT_DIR            # on the GPU machine (installs .whl/, then runs this)
    python3 scripts/device_check.py OUT_DIR --device cpu --quick   # every stage on a CPU, in seconds
    python3 scripts/device_check.py OUT_DIR --dry-run               # the plan and its H100 time estimate

Stages, each guarded (a failure is recorded in the summary and the next stage runs):

1. env:      GPU name, capability, memory, torch / CUDA / cuDNN / transformers versions, and the
             measured matmul peak (PEAK_N³ products: bf16, fp32 with TF32 off, and TF32 for reference).
2. tests:    `pytest -m cuda tests/test_cuda.py` in a subprocess (its verdicts, and the differences
             the tests measured, from TXL_CUDA_REPORT), killed at the end of its time slice.
3. train:    training-step throughput (forward, backward, clip 0.25, Adam) of txl with attention_impl
             eager, fast, sdpa and flex, and of Hugging Face TransfoXLLMHeadModel 4.35.2, at the tiny,
             enwik8-base and wt103-large-like shapes, in bf16 autocast and fp32 (TF32 off): tokens/s, peak
             GPU memory, MFU against the measured peak of the same precision, and apart from the step time
             the warm-up steps' seconds beyond steady steps (for flex: the compilation of its Triton
             kernels; txl.nn.attention.fused runs flex_attention under torch.compile on CUDA, the only
             way it is fused, so the flex contender is the compiled kernel).
4. checkpointing: txl with the impl `attention_impl="auto"` takes on the device (sdpa on CUDA, fast on
             the CPU) at the base and large shapes, with and without activation checkpointing (each
             block recomputed in the backward: `model.checkpoint_blocks`, which
             `train.activation_checkpointing="blocks"` sets): peak GPU memory and step time.
5. compile:  torch.compile of the whole model (what `train.compile=true` runs) at the base shape in bf16:
             compile seconds apart from the step time, against the same model uncompiled.
6. eval:     evaluation throughput (no grad, memory carried) at the base shape for two memory lengths.
7. generate: greedy generation with memory at the base shape (context 1024), against re-running it;
             eager, fast and sdpa (not flex: every new key length would compile its kernels anew).
Then OUT_DIR/device_check.json and OUT_DIR/device_check.md, rewritten after every measurement, so a
run cut short still leaves what it measured. A contender that is not available (transformers 4.35.2
missing, an impl not registered, flex training on the CPU) and a measurement that the time budget
leaves out are recorded as skipped, with the reason; they are not errors.

Time budget. `--budget-minutes` (default 8) counts from the start of device_check.sh (its start time
comes in TXL_DEVICE_CHECK_START); `--reserve-s` of it is kept free for what runs longer than estimated.
Each stage has a slice of the rest (STAGE_S, scaled to the budget and to the stages chosen); a stage
may also use what earlier stages left unused, never the slices of the stages after it. A measurement
starts only if its estimate fits in what its stage has left, else it is skipped and recorded; the
number of timed steps is chosen after the warm-up steps, from the measured step time, to fill
--timed-s seconds (at least 3, at most --reps) and never past the stage's end. Progress lines carry the
time and the seconds since the start.

Estimates (`plan`, printed by --dry-run): step time = max(model FLOPs / (efficiency × peak), launch
floor × layers), with the peak measured in stage env (before it: an H100's dense ~400 TFLOP/s bf16 and
~50 TFLOP/s fp32, NOMINAL_TFLOPS) and per-contender efficiencies and launch floors read off the first
run of this check on an H200 (docs/results/benchmarks.md: eager/fast 10-13% of the bf16 peak and
50-75% of the fp32 one, Hugging Face 2-5% and 20-45%; ~6 ms per layer of Python and launch time in a
training step); plus building the model (~10 ms per million parameters) and compiling (flex: ~20 s per
shape and precision, forward and backward, ~10 s forward only; the whole model: ~60 s; guesses until a
GPU has measured them). The defaults' plan on an H100 (--dry-run): set-up ~25 s, env 4 s, tests 120 s (its
time limit; 55 s on the H200 before the fused-attention tests), train 189 s (132 s of it compiling flex),
checkpointing 19 s, compile 62 s, eval 57 s (43 s of it flex), generate 12 s: 462 s of work for the 435 s
that 8 minutes leave after the set-up and the reserve, so the compile stage and flex's evaluation rows run
only if the stages before them finish under their estimates; else they are listed as skipped.

Timing: CUDA events around each step, median over the timed steps after warm-up steps (wall clock on
the CPU). Contenders run one after another (each builds its model once and runs both precisions), so
that each has its own peak-memory figure; a GPU has no noisy neighbour that alternation would even out.

MFU = model FLOPs of one training step / median step time / measured matmul peak of that precision.
Model FLOPs are `txl.bench.mfu.forward_flops` × 3 (backward = 2 × forward): per layer the q, k/v (over
memory + segment), output and feed-forward products, the position projection and the three score
products, counting a multiply-add as 2 FLOPs; that is 6 · (non-embedding matmul parameters) · tokens
plus the attention and the memory rows' key/value work. The head counts 2·d_model·vocab per token for a
full softmax; for an adaptive softmax (the wt103-large shape) the head cluster for every token plus each
tail cluster's projection and logits for the share of tokens that fall in it (`head_flops`), and the
input embedding's projections likewise. Tokens of the adaptive shape are drawn from a Zipf law (rank⁻¹)
so that ~80% fall in the head cluster, as in WikiText-103 text; other shapes use uniform tokens.

Known differences in what the contenders execute: Hugging Face's adaptive softmax (and its adaptive
embedding, div_val > 1) run in fp32 under bf16 autocast, because 4.35.2 fails there with a dtype
mismatch (transformers #19914); ours runs its head products in bf16 and its log-softmax in fp32. txl
uses its fused Adam (what `txl train` runs), Hugging Face torch's default Adam.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("env", "tests", "train", "checkpointing", "compile", "eval", "generate")
PRECISIONS = ("bf16", "fp32")
CONTENDERS = ("txl-eager", "txl-fast", "txl-sdpa", "txl-flex", "hf")
GENERATE_IMPLS = ("eager", "fast", "sdpa")
# The wheels for the Hugging Face comparison (.whl/, see scripts/device_check.sh): these three always
# (the machine's own transformers has no TransfoXL any more); the others only where the machine lacks
# them, so that nothing the machine's torch relies on is shadowed.
ALWAYS = ("transformers", "tokenizers", "huggingface_hub")
MODULE_OF = {"pyyaml": "yaml"}  # distribution -> import name, where they differ
PEAK_N = 8192
WT103_VOCAB = 267_735

# --- the time budget (seconds; see the module's docstring) ---
BUDGET_MINUTES = 8.0
SETUP_S = 25.0  # before stage env, counted in the budget: the shell, the wheels, importing torch, CUDA's start
# Each stage's slice on one H100, from `plan`'s estimates (--dry-run) and the H200 run's figures: the
# CUDA tests took 55 s there before the fused-attention tests (4 flex compilations) were added.
STAGE_S = {"env": 5.0, "tests": 120.0, "train": 200.0, "checkpointing": 25.0, "compile": 45.0, "eval": 25.0,
           "generate": 15.0}
RESERVE_S = 20.0
NOMINAL_TFLOPS = {"bf16": 400.0, "fp32": 50.0}  # an H100's dense matmul, until stage env measures the peak
# Model-FLOP efficiency against the measured peak, (bf16, fp32): the H200 run's MFU for eager, fast and
# Hugging Face at the base and large shapes; the fused and compiled ones guessed a little above fast.
EFFICIENCY = {"txl-eager": (0.10, 0.50), "txl-fast": (0.10, 0.60), "txl-sdpa": (0.15, 0.50),
              "txl-flex": (0.15, 0.50), "hf": (0.03, 0.30), "compiled": (0.20, 0.60)}
LAUNCH_S = {"train": 6e-3, "eval": 1.5e-3, "token": 1.5e-3}  # per layer: a step's floor when the GPU waits on Python
FLEX_COMPILE_S = {"train": 20.0, "eval": 10.0}  # per shape and precision, on CUDA
MODEL_COMPILE_S = 60.0  # torch.compile of the whole model, forward and backward, on CUDA
BUILD_S_PER_PARAM = 1e-8
MIN_REPS = 3

START_UNIX = time.time()  # the run's start for the progress lines (main sets it from TXL_DEVICE_CHECK_START)


def log(message: str) -> None:
    """One progress line with the wall-clock time and the minutes:seconds since the start (the
    caller's output is unbuffered)."""
    now = datetime.datetime.now().strftime("%H:%M:%S")
    elapsed = max(0, int(time.time() - START_UNIX))
    print(f"[{now} +{elapsed // 60}:{elapsed % 60:02d}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Wheels (run before anything else is imported; needs only the standard library)


def wheel_distribution(path: str | Path) -> str:
    """`transformers-4.35.2-py3-none-any.whl` -> `transformers` (normalised: lower case, `_`)."""
    return re.sub(r"[-_.]+", "_", Path(path).name.split("-")[0]).lower()


def wheel_fits(path: str | Path) -> bool:
    """Whether this Python can use the wheel: pure ones always, CPython ones built for this version
    (or the stable ABI); the platform is left to pip."""
    python_tag, abi_tag = Path(path).name.removesuffix(".whl").split("-")[-3:-1]
    return not python_tag.startswith("cp") or abi_tag == "abi3" or python_tag == f"cp{sys.version_info[0]}{sys.version_info[1]}"


def pick_wheels(folder: str | Path) -> list[Path]:
    """The wheels of `folder` to install: ALWAYS ones, and the others whose module this Python lacks;
    only those built for this Python."""
    picked = []
    for wheel in sorted(Path(folder).glob("*.whl")):
        name = wheel_distribution(wheel)
        if not wheel_fits(wheel):
            log(f"install: {wheel.name} is not for Python {platform.python_version()}: skipped")
        elif name in ALWAYS or importlib.util.find_spec(MODULE_OF.get(name, name)) is None:
            picked.append(wheel)
    return picked


def install_wheels(folder: str | Path, target: str | Path) -> int:
    """Install the picked wheels into `target` with pip (offline, no dependencies); where this Python
    has no pip, unpack them there (a wheel is a zip of its import tree). Returns how many."""
    wheels = pick_wheels(folder)
    if not wheels:
        log(f"install: no wheels to install from {folder}")
        return 0
    log(f"install: {', '.join(w.name for w in wheels)} -> {target}")
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout + proc.stderr, end="", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"install: pip failed ({proc.returncode}); the Hugging Face comparison runs only if "
                             "this Python already has transformers 4.35.2")
    else:
        Path(target).mkdir(parents=True, exist_ok=True)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
    return len(wheels)



# ---------------------------------------------------------------------------------------------
# Shapes and FLOPs


def shapes() -> dict:
    """The benchmark shapes by name: the bench's tiny and enwik8-base (with the paper's batch 22),
    a wt103-large-like one, and two micro shapes for a CPU smoke run."""
    from txl.bench.common import SHAPES, Shape

    adaptive = (("cutoffs", (20000, 40000, 200000)), ("div_val", 4))
    return {
        "tiny": SHAPES["tiny"],
        "base": Shape("base", n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=512, mem_len=512,
                      batch=22, eval_tgt_len=128, eval_batch=16, eval_mem_lens=(512, 3800)),
        # wt103-large (Dai et al. 2019: 18 x 1024, 16 x 64 heads, adaptive softmax, div_val 4), tgt = mem = 384;
        # batch 16 of the paper's 128 keeps a step short
        "large": Shape("large", n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, tgt_len=384,
                       mem_len=384, batch=16, vocab=WT103_VOCAB, dropout=0.2, eval_tgt_len=128, eval_batch=16,
                       eval_mem_lens=(1600,), extra=adaptive),
        "micro": Shape("micro", n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=16, mem_len=16,
                       batch=2, eval_tgt_len=16, eval_batch=2, eval_mem_lens=(16,)),
        "micro-adaptive": Shape("micro-adaptive", n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=16,
                                mem_len=16, batch=2, vocab=300, eval_tgt_len=16, eval_batch=2, eval_mem_lens=(16,),
                                extra=(("cutoffs", (40, 120)), ("div_val", 2))),
    }


def cluster_fractions(shape) -> list[float]:
    """The share of tokens in each softmax cluster under the token law the benchmark draws from
    (Zipf for an adaptive softmax, else uniform): [1.0] for a full softmax."""
    cutoffs = list(dict(shape.extra).get("cutoffs", ()))
    if not cutoffs:
        return [1.0]
    bounds = [0, *cutoffs, shape.vocab]
    harmonic = [0.0]
    for rank in range(1, shape.vocab + 1):
        harmonic.append(harmonic[-1] + 1.0 / rank)
    return [(harmonic[hi] - harmonic[lo]) / harmonic[-1] for lo, hi in zip(bounds, bounds[1:])]


def head_flops(shape, tokens: int) -> float:
    """Forward FLOPs of the input projections and the softmax head for `tokens` tokens (expected
    values for an adaptive softmax: each tail cluster counts for its share of the tokens)."""
    extra = dict(shape.extra)
    cutoffs, div_val, d = list(extra.get("cutoffs", ())), extra.get("div_val", 1), shape.d_model
    if not cutoffs:
        return 2 * tokens * d * shape.vocab
    bounds = [0, *cutoffs, shape.vocab]
    dims = [d // div_val**i for i in range(len(bounds) - 1)] if div_val != 1 else [d] * (len(bounds) - 1)
    projected = [dim != d or div_val != 1 for dim in dims]  # div_val > 1 projects every cluster
    total = 0.0
    for i, (fraction, dim) in enumerate(zip(cluster_fractions(shape), dims)):
        size = bounds[i + 1] - bounds[i]
        share = tokens if i == 0 else fraction * tokens  # every token scores the head cluster
        proj = 2 * d * dim if projected[i] else 0
        total += share * (proj + 2 * dim * (size + (len(cutoffs) if i == 0 else 0)))
        total += fraction * tokens * proj  # the input embedding's projection of this cluster's tokens
    return total


def train_flops(shape) -> float:
    """Model FLOPs of one training step: 3 × the forward (txl.bench.mfu), its head per `head_flops`."""
    from txl.bench.mfu import forward_flops

    tokens = shape.batch * shape.tgt_len
    body = forward_flops(shape) - 2 * tokens * shape.d_model * shape.vocab
    return 3 * (body + head_flops(shape, tokens))


# ---------------------------------------------------------------------------------------------
# Time budget and estimates


class BudgetSpent(Exception):
    """Not even one timed step fits in what the stage has left."""


def spent_before_start() -> float:
    """Seconds since device_check.sh started (TXL_DEVICE_CHECK_START, unix time), else 0."""
    try:
        return min(max(time.time() - float(os.environ.get("TXL_DEVICE_CHECK_START", "")), 0.0), 3600.0)
    except ValueError:
        return 0.0


class Budget:
    """The run's deadline and each stage's end. `clock` is monotonic seconds (tests pass a fake one).

    Measurements start only before `end` = start + total - reserve. The stages share what is left when
    the budget is made in proportion to their STAGE_S slices; a stage ends where the slices of the
    stages after it begin, counted back from `end`, so it may use what earlier stages left unused but
    never what later ones were given."""

    def __init__(self, total_s: float, stages, *, reserve_s: float = RESERVE_S, spent_s: float = 0.0,
                 clock=time.monotonic, slices: dict[str, float] | None = None):
        self.clock = clock
        now = clock()
        self.start = now - spent_s
        self.total_s = total_s
        self.end = self.start + total_s - reserve_s
        self.slices = {stage: (slices or STAGE_S)[stage] for stage in stages}
        self.scale = max(self.end - now, 0.0) / max(sum(self.slices.values()), 1e-9)
        self.stage: str | None = None
        self.stage_end = self.end

    def slice_s(self, stage: str) -> float:
        """The stage's own share of the budget (seconds)."""
        return self.scale * self.slices[stage]

    def begin(self, stage: str) -> None:
        names = list(self.slices)
        later = names[names.index(stage) + 1 :] if stage in names else []
        self.stage = stage
        self.stage_end = self.end - sum(self.slice_s(s) for s in later)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds left to the current stage."""
        return self.stage_end - self.clock()

    def total_left(self) -> float:
        return self.end - self.clock()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


def efficiency(contender: str, precision: str) -> float:
    key = "compiled" if contender.endswith(" compiled") else contender
    return EFFICIENCY.get(key, (0.10, 0.50))[PRECISIONS.index(precision)]


def peak_tflops(peak: dict, precision: str) -> float:
    value = peak.get(precision)
    return value if isinstance(value, float) and value > 0 else NOMINAL_TFLOPS[precision]


def step_estimate_s(flops: float, contender: str, precision: str, n_layer: int, peak: dict, kind: str = "train") -> float:
    """Seconds of one step: the model FLOPs at the contender's efficiency, or the launch floor."""
    compute = flops / (efficiency(contender, precision) * peak_tflops(peak, precision) * 1e12)
    return max(compute, LAUNCH_S[kind] * n_layer)


def reps_for(step_s: float, args: argparse.Namespace) -> int:
    """Timed steps: as many as fill --timed-s, at least MIN_REPS (or --reps, if fewer), at most --reps."""
    return max(min(MIN_REPS, args.reps), min(args.reps, int(args.timed_s / max(step_s, 1e-9))))


def approx_params(shape) -> float:
    """Parameters of a shape, roughly (to estimate building it): the blocks, and an embedding and a head
    of d_model per token, or of each adaptive cluster's width."""
    extra = dict(shape.extra)
    bounds = [0, *extra.get("cutoffs", ()), shape.vocab]
    div_val = extra.get("div_val", 1)
    embedding = sum((hi - lo) * shape.d_model // div_val**i for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])))
    hd = shape.n_head * shape.d_head
    return shape.n_layer * (4 * shape.d_model * hd + 2 * shape.d_model * shape.d_inner) + 2 * embedding


def build_estimate_s(shape) -> float:
    return 0.5 + BUILD_S_PER_PARAM * approx_params(shape)


def compile_estimate_s(contender: str, kind: str, device: str) -> float:
    if device != "cuda":
        return 0.0
    if contender.endswith(" compiled"):
        return MODEL_COMPILE_S
    return FLEX_COMPILE_S[kind] if contender == "txl-flex" else 0.0


def measurement_s(step_s: float, contender: str, kind: str, args: argparse.Namespace, shape=None) -> float:
    """A measurement's seconds: warm-up and timed steps, compiling, and building the model if `shape`."""
    build = build_estimate_s(shape) if shape is not None else 0.0
    return build + compile_estimate_s(contender, kind, args.device) + (args.warmup + reps_for(step_s, args)) * step_s


def auto_impl(device: str) -> str:
    """The impl `attention_impl="auto"` takes for full attention on `device` (sdpa on CUDA, fast on the
    CPU, per txl.nn.attention.registry)."""
    from txl.nn.attention.registry import auto_impl as choose

    return choose("full", device)


def eval_flops(shape, mem_len: int) -> float:
    from txl.bench.mfu import forward_flops

    return forward_flops(shape, tgt_len=shape.eval_tgt_len, mem_len=mem_len, batch=shape.eval_batch)


def plan(args: argparse.Namespace, peak: dict | None = None) -> list[dict]:
    """What a run with these arguments measures, one item per measurement with its estimated seconds
    (`stage`, `what`, `estimate_s`); the stages skip what does not fit by the same estimates."""
    from txl.bench.mfu import forward_flops

    peak = peak or {}
    table = shapes()
    items: list[dict] = []

    def add(stage: str, what: str, seconds: float) -> None:
        items.append({"stage": stage, "what": what, "estimate_s": round(seconds, 2)})

    if "env" in args.stages:
        names = ["bf16", "fp32"] + (["tf32"] if args.device == "cuda" else [])
        seconds = 3.0 + sum((2 + args.peak_reps) * 2 * args.peak_n**3 / (peak_tflops(peak, "fp32" if n != "bf16" else
                                                                                       "bf16") * 1e12) for n in names)
        add("env", f"versions; matmul peak {args.peak_n}^3 in {', '.join(names)}", seconds)
    if "tests" in args.stages:
        add("tests", "pytest -m cuda tests/test_cuda.py", min(args.tests_timeout_s, STAGE_S["tests"]))
    if "train" in args.stages:
        for shape_name in args.shapes:
            shape = table[shape_name]
            flops = train_flops(shape)
            for contender in args.contenders:
                for i, precision in enumerate(args.precisions):
                    step = step_estimate_s(flops, contender, precision, shape.n_layer, peak)
                    add("train", f"{shape_name} {precision} {contender}",
                        measurement_s(step, contender, "train", args, shape if i == 0 else None))
    auto = f"txl-{auto_impl(args.device)}"
    if "checkpointing" in args.stages:
        for shape_name in args.ckpt_shapes:
            shape = table[shape_name]
            flops = train_flops(shape)
            for i, precision in enumerate(args.precisions):
                for mode in ("none", "blocks"):
                    step = step_estimate_s(flops, auto, precision, shape.n_layer, peak) * (4 / 3 if mode == "blocks" else 1)
                    add("checkpointing", f"{shape_name} {precision} {auto} {mode}",
                        measurement_s(step, auto, "train", args, shape if i == 0 and mode == "none" else None))
    if "compile" in args.stages:
        shape, precision = table[args.compile_shape], compile_precision(args)
        flops = train_flops(shape)
        if not ("train" in args.stages and args.compile_shape in args.shapes and auto in args.contenders
                and precision in args.precisions):
            step = step_estimate_s(flops, auto, precision, shape.n_layer, peak)
            add("compile", f"{args.compile_shape} {precision} {auto}", measurement_s(step, auto, "train", args, shape))
        step = step_estimate_s(flops, f"{auto} compiled", precision, shape.n_layer, peak)
        add("compile", f"{args.compile_shape} {precision} {auto} compiled",
            measurement_s(step, f"{auto} compiled", "train", args, shape) + step)  # one more warm-up step
    if "eval" in args.stages:
        shape = table[args.eval_shape]
        for mem_len in args.eval_mem_lens or shape.eval_mem_lens:
            flops = eval_flops(shape, mem_len)
            for contender in args.contenders:
                for i, precision in enumerate(args.precisions):
                    step = step_estimate_s(flops, contender, precision, shape.n_layer, peak, "eval")
                    add("eval", f"{shape.name} mem {mem_len} {precision} {contender}",
                        measurement_s(step, contender, "eval", args, shape if i == 0 else None))
    if "generate" in args.stages:
        shape = table[args.eval_shape]
        for impl in GENERATE_IMPLS:
            if f"txl-{impl}" not in args.contenders:
                continue
            for i, precision in enumerate(args.precisions):
                rerun = step_estimate_s(forward_flops(shape, tgt_len=args.context, mem_len=0, batch=1), f"txl-{impl}",
                                        precision, shape.n_layer, peak, "eval")
                tokens = args.warmup * 8 + args.new_tokens + 1
                seconds = 5 * rerun + tokens * LAUNCH_S["token"] * shape.n_layer + (build_estimate_s(shape) if i == 0 else 0)
                add("generate", f"{shape.name} context {args.context} {precision} txl-{impl}", seconds)
    return items


def compile_precision(args: argparse.Namespace) -> str:
    return "bf16" if "bf16" in args.precisions else args.precisions[0]


# ---------------------------------------------------------------------------------------------
# Summary


def add_ratios(rows: list[dict], group: tuple[str, ...]) -> None:
    """Ratios of tokens/s between rows that share `group` (and `mode`, where rows have one): x_hf
    (over Hugging Face's), x_eager (over txl-eager's), x_fp32 (a bf16 row over the same contender's
    fp32 row) and x_sdpa (a txl-flex row over txl-sdpa's)."""
    keys = (*group, "mode", "contender")

    def key(row: dict, **change) -> tuple:
        return tuple(change.get(k, row.get(k)) for k in keys)

    speed = {key(row): row["tokens_per_s"] for row in rows if row.get("tokens_per_s")}
    for row in rows:
        if not row.get("tokens_per_s"):
            continue
        for field, change, applies in (("x_hf", {"contender": "hf"}, True),
                                       ("x_eager", {"contender": "txl-eager"}, True),
                                       ("x_fp32", {"precision": "fp32"}, row.get("precision") == "bf16"),
                                       ("x_sdpa", {"contender": "txl-sdpa"}, row.get("contender") == "txl-flex")):
            reference = speed.get(key(row, **change)) if applies else None
            if reference:
                row[field] = row["tokens_per_s"] / reference


def add_checkpointing_ratios(rows: list[dict]) -> None:
    """x_peak and x_step: a row with checkpointing over the same shape, precision and contender without."""
    plain = {(r["shape"], r.get("precision"), r["contender"]): r for r in rows
             if r.get("checkpointing") == "none" and r.get("step_ms")}
    for row in rows:
        base = plain.get((row["shape"], row.get("precision"), row["contender"]))
        if base and row.get("step_ms"):
            row["x_step"] = row["step_ms"] / base["step_ms"]
            if row.get("peak_gib") and base.get("peak_gib"):
                row["x_peak"] = row["peak_gib"] / base["peak_gib"]


def sdpa_against_flex(result: dict) -> list[dict]:
    """One row per training / evaluation setting where both fused impls were measured."""
    rows = []
    for stage in ("train", "eval"):
        found: dict[tuple, dict] = {}
        for row in result.get(stage, []):
            if row.get("contender") in ("txl-sdpa", "txl-flex") and row.get("tokens_per_s"):
                found.setdefault((row["shape"], row.get("mem_len"), row["precision"]), {})[row["contender"]] = row
        for (shape, mem_len, precision), pair in found.items():
            if len(pair) == 2:
                sdpa, flex = pair["txl-sdpa"], pair["txl-flex"]
                rows.append({"stage": stage, "shape": shape, "mem_len": mem_len, "precision": precision,
                             "sdpa": sdpa["tokens_per_s"], "flex": flex["tokens_per_s"],
                             "x_sdpa": flex["tokens_per_s"] / sdpa["tokens_per_s"], "sdpa_peak": sdpa.get("peak_gib"),
                             "flex_peak": flex.get("peak_gib"), "flex_compile": flex.get("warmup_extra_s")})
    return rows


def percent(value) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def markdown(result: dict) -> str:
    from txl.bench.common import markdown_table

    env = result.get("env", {})
    peak = result.get("peak", {})
    lines = ["# txl device check", ""]
    gpu = env.get("gpu")
    if gpu:
        lines.append(f"- GPU: {gpu} (compute capability {env.get('capability')}, {env.get('memory_gib', 0):.1f} GiB, "
                     f"{env.get('sm_count')} SMs); driver {env.get('driver', '?')}")
    else:
        lines.append(f"- device: {result.get('args', {}).get('device')} ({env.get('cpu', '?')})")
    lines.append(f"- torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}); Python "
                 f"{env.get('python')}; transformers {env.get('transformers') or 'not available'}")
    if peak:
        parts = [f"{name} {value:.1f} TFLOP/s" for name, value in peak.items() if isinstance(value, float)]
        lines.append(f"- matmul peak ({peak.get('n')}³, median): " + ", ".join(parts))
    lines.append(f"- status: {result.get('status')}, {result.get('elapsed_s', 0):.0f} s; "
                 f"{len(result.get('errors', []))} error(s), {len(result.get('skipped', []))} skipped")
    budget = result.get("budget")
    if budget:
        used = ", ".join(f"{stage} {info['used_s']:.0f}/{info['slice_s']:.0f} s"
                         for stage, info in budget.get("stages", {}).items() if "used_s" in info)
        lines.append(f"- time budget: {budget['total_s']:.0f} s from the start of device_check.sh "
                     f"({budget.get('spent_before_s', 0):.0f} s before this script); per stage, used/slice: {used or '–'}")
    tests = result.get("tests")
    if tests:
        lines += ["", "## CUDA tests (`pytest -m cuda tests/test_cuda.py`)", "",
                  f"{tests.get('summary', '?')} (exit {tests.get('rc')}, {tests.get('seconds', 0):.0f} s)"]
        bad = [t for t in tests.get("outcomes", []) if t["outcome"] not in ("PASSED", "SKIPPED")]
        if bad:
            lines += ["", markdown_table(bad, [("test", "test"), ("outcome", "outcome")])]
        figures = [{"test": f["test"], "figures": ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                           for k, v in f.items() if k not in ("test", "device", "losses"))}
                   for f in tests.get("figures", [])]
        if figures:
            lines += ["", markdown_table(figures, [("test", "measured in"), ("figures", "differences")])]
    train = result.get("train", [])
    if train:
        rows = [dict(r, mfu=percent(r.get("mfu"))) for r in train]
        lines += ["", "## Training throughput (forward + backward + clip + Adam)", "",
                  markdown_table(rows, [("shape", "shape"), ("precision", "precision"), ("contender", "contender"),
                                        ("tokens_per_s", "tokens/s"), ("step_ms", "step ms"),
                                        ("warmup_extra_s", "warm-up extra s"), ("peak_gib", "peak GiB"),
                                        ("tflops", "model TFLOP/s"), ("mfu", "MFU"), ("x_hf", "× HF"),
                                        ("x_eager", "× eager"), ("x_fp32", "bf16 × fp32"), ("error", "error")])]
        described = {r["shape"]: r.get("describe") for r in train if r.get("describe")}
        lines += [""] + [f"- {name}: {text}" for name, text in described.items()]
        lines.append("- warm-up extra s: the warm-up steps' seconds beyond as many steady steps (for txl-flex: "
                     "compiling its kernels); bf16 × fp32: a bf16 row's tokens/s over the same contender's fp32 row")
    fused = sdpa_against_flex(result)
    if fused:
        lines += ["", "## Fused attention: sdpa against flex", "",
                  markdown_table(fused, [("stage", "stage"), ("shape", "shape"), ("mem_len", "mem_len"),
                                         ("precision", "precision"), ("sdpa", "sdpa tokens/s"),
                                         ("flex", "flex tokens/s"), ("x_sdpa", "flex × sdpa"),
                                         ("sdpa_peak", "sdpa peak GiB"), ("flex_peak", "flex peak GiB"),
                                         ("flex_compile", "flex compile s")])]
    checkpointing = result.get("checkpointing", [])
    if checkpointing:
        lines += ["", "## Activation checkpointing (train.activation_checkpointing)", "",
                  markdown_table(checkpointing, [("shape", "shape"), ("precision", "precision"),
                                                 ("contender", "contender"), ("checkpointing", "checkpointing"),
                                                 ("tokens_per_s", "tokens/s"), ("step_ms", "step ms"),
                                                 ("peak_gib", "peak GiB"), ("x_peak", "× peak memory"),
                                                 ("x_step", "× step time"), ("error", "error")])]
    compiled = result.get("compile", [])
    if compiled:
        rows = [dict(r, mfu=percent(r.get("mfu"))) for r in compiled]
        lines += ["", "## torch.compile of the whole model (train.compile)", "",
                  markdown_table(rows, [("shape", "shape"), ("precision", "precision"), ("contender", "contender"),
                                        ("backend", "backend"), ("warmup_extra_s", "compile s"),
                                        ("tokens_per_s", "tokens/s"), ("step_ms", "step ms"), ("peak_gib", "peak GiB"),
                                        ("mfu", "MFU"), ("x_uncompiled", "× uncompiled"), ("error", "error")])]
    evaluation = result.get("eval", [])
    if evaluation:
        lines += ["", "## Evaluation throughput (no grad, memory carried)", "",
                  markdown_table(evaluation, [("shape", "shape"), ("mem_len", "mem_len"), ("precision", "precision"),
                                              ("contender", "contender"), ("tokens_per_s", "tokens/s"),
                                              ("warmup_extra_s", "warm-up extra s"), ("peak_gib", "peak GiB"),
                                              ("x_hf", "× HF"), ("x_eager", "× eager"), ("x_fp32", "bf16 × fp32"),
                                              ("error", "error")])]
    generation = result.get("generate", [])
    if generation:
        lines += ["", "## Generation with memory (batch 1, greedy)", "",
                  markdown_table(generation, [("shape", "shape"), ("context", "context"), ("precision", "precision"),
                                              ("contender", "contender"), ("mode", "mode"), ("tokens_per_s", "tokens/s"),
                                              ("ms_per_token", "ms/token"), ("x_rerun", "× re-run"),
                                              ("x_eager", "× eager"), ("x_fp32", "bf16 × fp32"), ("error", "error")])]
    skipped = result.get("skipped", [])
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {s['stage']} / {s['what']}: {s['reason']}" for s in skipped]
    errors = result.get("errors", [])
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e['stage']} / {e['what']}: {e['error']}" for e in errors]
    lines += ["", f"MFU: {result.get('flops_formula', '')}", ""]
    return "\n".join(lines)


def write_summary(result: dict, out: Path) -> None:
    """device_check.json and device_check.md in `out`, with the ratios filled in."""
    from txl.io import write_text

    add_ratios(result.get("train", []), ("shape", "precision"))
    add_ratios(result.get("eval", []), ("shape", "mem_len", "precision"))
    add_ratios(result.get("generate", []), ("shape", "precision", "mode"))
    add_checkpointing_ratios(result.get("checkpointing", []))
    result["elapsed_s"] = time.time() - result["started_unix"]
    write_text(out / "device_check.json", json.dumps(result, indent=2, default=str) + "\n")
    write_text(out / "device_check.md", markdown(result))


# ---------------------------------------------------------------------------------------------
# The run


class Check:
    """The state of one run: arguments, device, results, the time budget."""

    def __init__(self, args: argparse.Namespace, *, clock=None, spent_s: float | None = None):
        import torch

        self.args = args
        self.out = Path(args.out)
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        spent = spent_before_start() if spent_s is None else spent_s
        self.budget = Budget(args.budget_minutes * 60, args.stages, reserve_s=args.reserve_s, spent_s=spent,
                             clock=clock or time.monotonic)
        self.unavailable: dict[str, str | None] = {}
        self.result = {
            "status": "running", "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "started_unix": time.time() - spent, "args": vars(args), "env": {}, "peak": {}, "train": [],
            "checkpointing": [], "compile": [], "eval": [], "generate": [], "errors": [], "skipped": [],
            "budget": {"total_s": self.budget.total_s, "reserve_s": args.reserve_s, "spent_before_s": spent,
                       "stages": {stage: {"slice_s": round(self.budget.slice_s(stage), 1)} for stage in args.stages}},
            "flops_formula": ("model FLOPs of a training step = 3 × forward (txl.bench.mfu.forward_flops: per "
                              "layer q, k/v over memory + segment, output, FFN, position projection and 3 "
                              "score products; 2 FLOPs per multiply-add), i.e. 6 · non-embedding params · "
                              "tokens + attention; the head 2·d·V per token, or its expected cost under an "
                              "adaptive softmax; MFU = that / median step time / matmul peak of the precision"),
        }

    def save(self) -> None:
        write_summary(self.result, self.out)

    def error(self, stage: str, what: str, err: BaseException) -> str:
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:400]
        frames = traceback.extract_tb(err.__traceback__)[-3:]
        where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
        self.result["errors"].append({"stage": stage, "what": what, "error": message, "where": where})
        log(f"ERROR {stage} / {what}: {message} ({where})")
        return message

    def skip(self, stage: str, what: str, reason: str) -> None:
        self.result["skipped"].append({"stage": stage, "what": what, "reason": reason})
        log(f"skip {stage} / {what}: {reason}")

    def fits(self, stage: str, what: str, seconds: float) -> bool:
        """Whether a measurement estimated at `seconds` fits in the stage's time left; if not, it is
        recorded as skipped."""
        if self.budget.fits(seconds):
            return True
        self.skip(stage, what, f"time budget: needs ~{seconds:.0f} s, {max(self.budget.left(), 0):.0f} s left "
                               f"for stage {stage}")
        return False

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        if not self.cuda:
            return None
        import torch

        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def time_steps(self, step, *, warmup: int, reps: int) -> tuple[list[float], list[float]]:
        """Seconds of each of `warmup` calls of `step`, then of each timed call: CUDA events on a GPU,
        else the wall clock. After the warm-up the number of timed calls is cut to what fills --timed-s
        (at least MIN_REPS) and to what the stage has left; BudgetSpent if not even one fits."""
        import torch

        warm = []
        for _ in range(warmup):
            start = time.perf_counter()
            step()
            self.sync()
            warm.append(time.perf_counter() - start)
        if warm:
            guess = max(warm[-1], 1e-6)
            reps = min(reps, max(min(MIN_REPS, reps), int(self.args.timed_s / guess)))
            room = int(self.budget.left() / guess)
            if room < 1:
                raise BudgetSpent(f"a step takes ~{guess:.2f} s, {max(self.budget.left(), 0):.0f} s left")
            reps = min(reps, room)
        if not self.cuda:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            return warm, times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        self.sync()
        return warm, [start.elapsed_time(end) / 1000 for start, end in events]

    def autocast(self, precision: str):
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def timed(self, row: dict, step, *, tokens: int, flops: float | None = None, precision: str | None = None,
              warmup: int | None = None) -> dict:
        """Time `step` into `row`: tokens/s, step ms (median), every step's ms, the warm-up's extra
        seconds over as many steady steps (compiling, autotuning), peak GiB, and with `flops` the
        model TFLOP/s and MFU."""
        self.reset_peak()
        warm, times = self.time_steps(step, warmup=self.args.warmup if warmup is None else warmup, reps=self.args.reps)
        median = statistics.median(times)
        row.update(tokens_per_s=tokens / median, step_ms=1000 * median, step_ms_all=[1000 * t for t in times],
                   warmup_s=sum(warm), warmup_extra_s=max(sum(warm) - len(warm) * median, 0.0), reps=len(times),
                   peak_gib=self.peak_gib())
        if flops is not None:
            row["tflops"] = flops / median / 1e12
            measured = self.result["peak"].get(precision)
            if isinstance(measured, float):
                row["mfu"] = row["tflops"] / measured
        return row


def describe_row(row: dict) -> str:
    parts = [f"{row['tokens_per_s']:,.0f} tokens/s", f"step {row['step_ms']:.1f} ms"]
    if row.get("tflops") is not None:
        parts.append(f"{row['tflops']:.1f} TFLOP/s")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("peak_gib") is not None:
        parts.append(f"peak {row['peak_gib']:.2f} GiB")
    if row.get("warmup_extra_s", 0) > 1:
        parts.append(f"warm-up +{row['warmup_extra_s']:.1f} s")
    return ", ".join(parts)


# --- stage 1: the environment and the matmul peak ----------------------------------------------


def stage_env(check: Check) -> None:
    import torch

    env = check.result["env"]
    env.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
               transformers=hf_version(check), cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        env.update(gpu=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(check.device))),
                   memory_gib=props.total_memory / 2**30, sm_count=props.multi_processor_count)
        if shutil.which("nvidia-smi"):
            with contextlib.suppress(Exception):
                query = "driver_version,clocks.max.sm,power.limit"
                text = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
                env["driver"], env["max_sm_clock"], env["power_limit"] = (x.strip() for x in text.split(","))
    log(f"env: {env.get('gpu', 'CPU')} capability {env.get('capability')}, torch {env['torch']} CUDA {env['cuda']}, "
        f"transformers {env['transformers']}")
    check.save()
    n = check.args.peak_n
    peak = check.result["peak"]
    peak["n"] = n
    for name, dtype, fp32_precision in (("bf16", torch.bfloat16, "highest"), ("fp32", torch.float32, "highest"),
                                         ("tf32", torch.float32, "high")):
        if name == "tf32" and not check.cuda:
            continue
        try:
            torch.set_float32_matmul_precision(fp32_precision)
            a = torch.randn(n, n, device=check.device).to(dtype)
            b = torch.randn(n, n, device=check.device).to(dtype)
            with torch.no_grad():
                _, times = check.time_steps(lambda a=a, b=b: a @ b, warmup=2, reps=check.args.peak_reps)
            peak[name] = 2 * n**3 / statistics.median(times) / 1e12
            log(f"env: matmul peak {name} {peak[name]:.1f} TFLOP/s")
            del a, b
        except Exception as err:  # noqa: BLE001 - recorded, the next measurement runs
            check.error("env", f"peak {name}", err)
        finally:
            torch.set_float32_matmul_precision("highest")  # fp32 runs are TF32-off throughout
        check.save()
    check.free()


# --- stage 2: the CUDA tests ---------------------------------------------------------------------


def parse_pytest(output: str) -> tuple[list[dict], str]:
    """Each test's outcome from `pytest -v` output, and its closing summary line."""
    outcomes = [{"test": m.group(1), "outcome": m.group(2)}
                for m in re.finditer(r"^tests/test_cuda\.py::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)",
                                     output, re.M)]
    summary = next((line.strip("= ") for line in reversed(output.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", line)), "no summary line")
    return outcomes, summary


def stage_tests(check: Check) -> None:
    timeout = min(check.args.tests_timeout_s, check.budget.left())
    if timeout < 20:
        check.skip("tests", "pytest -m cuda", f"time budget: {max(timeout, 0):.0f} s left for stage tests")
        return
    report = check.out / "cuda_figures.jsonl"
    report.unlink(missing_ok=True)
    env = {**os.environ, "TXL_CUDA_REPORT": str(report.resolve()), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-v", "-p", "no:cacheprovider",
           "-p", "no:xdist", "-rfE", "--tb=short"]
    log(f"tests: {' '.join(cmd[1:])} (timeout {timeout:.0f} s)")
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        output += f"\n(killed after {timeout:.0f} s)\n"
        rc = "timeout"
    from txl.io import write_text

    write_text(check.out / "pytest.txt", output)
    outcomes, summary = parse_pytest(output)
    figures = []
    if report.exists():
        from txl.io import CONFIG_LIMIT, read_text

        text = read_text(report, what="the CUDA tests' figures", limit=CONFIG_LIMIT)
        figures = [json.loads(line) for line in text.splitlines() if line.strip()]
    check.result["tests"] = {"rc": rc, "summary": summary, "seconds": time.time() - start, "outcomes": outcomes,
                             "figures": figures}
    log(f"tests: {summary} (exit {rc})")
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            log(f"tests: {line}")


# --- stages 3-7: throughput, memory, compile ------------------------------------------------------


def token_stream(shape, rows: int, length: int, *, seed: int = 0):
    """Random token ids (rows, length): Zipf-distributed for an adaptive softmax (most in the head
    cluster, as in real text), else uniform."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if dict(shape.extra).get("cutoffs"):
        weights = 1.0 / torch.arange(1, shape.vocab + 1, dtype=torch.float64)
        return torch.multinomial(weights, rows * length, replacement=True, generator=generator).view(rows, length)
    return torch.randint(0, shape.vocab, (rows, length), generator=generator)


def build_hf(shape, *, mem_len: int | None = None, tgt_len: int | None = None):
    """Hugging Face TransfoXLLMHeadModel of `shape` (with its adaptive softmax, if any), on the CPU.
    The softmax (and a div_val > 1 embedding) run in fp32 under autocast on any device (see above)."""
    import warnings

    import torch

    extra = dict(shape.extra)
    unknown = set(extra) - {"cutoffs", "div_val", "dropatt"}
    if unknown:
        raise ValueError(f"the Hugging Face model mirrors plain and adaptive shapes only, not {sorted(unknown)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import TransfoXLConfig, TransfoXLLMHeadModel

        torch.manual_seed(0)
        config = TransfoXLConfig(
            vocab_size=shape.vocab, n_layer=shape.n_layer, d_model=shape.d_model, d_embed=shape.d_model,
            n_head=shape.n_head, d_head=shape.d_head, d_inner=shape.d_inner,
            mem_len=shape.mem_len if mem_len is None else mem_len, tgt_len=tgt_len or shape.tgt_len,
            cutoffs=list(extra.get("cutoffs", [])), div_val=extra.get("div_val", 1), dropout=shape.dropout, dropatt=0.0,
            clamp_len=-1, untie_r=False, same_length=False,
        )
        model = TransfoXLLMHeadModel(config)

    def fp32(forward, cast_first: bool):
        def run(*args, **kwargs):
            device = next(model.parameters()).device.type
            with torch.autocast(device, enabled=False):
                if cast_first:
                    args = (args[0].float(), *args[1:])
                return forward(*args, **kwargs)

        return run

    model.crit.forward = fp32(model.crit.forward, cast_first=True)
    if config.div_val != 1:
        model.transformer.word_emb.forward = fp32(model.transformer.word_emb.forward, cast_first=False)
    return model


def build_contender(name: str, shape, device, *, mem_len: int | None = None, train: bool = True):
    from txl.bench.common import build_ours

    if name == "hf":
        return build_hf(shape, mem_len=mem_len).to(device).train(train)
    return build_ours(shape, name.removeprefix("txl-"), mem_len=mem_len, train=train).to(device)


def make_train_step(name: str, model, shape, check: Check):
    """One training step of contender `name` at `precision`: a callable step(precision) -> loss tensor."""
    import torch

    from txl.nn.memory import Memory
    from txl.train.optim import build_optimizer

    batch, tgt = shape.batch, shape.tgt_len
    stream = token_stream(shape, batch, 16 * tgt + 1).to(check.device)
    position = [0]

    def segment():
        start = position[0]
        position[0] = (start + tgt) % (15 * tgt)
        return stream[:, start : start + tgt], stream[:, start + 1 : start + tgt + 1]

    params = list(model.parameters())
    if name == "hf":
        optimizer = torch.optim.Adam(params, lr=2.5e-4)
        mems = [None]

        def step(precision: str):
            inputs, _ = segment()
            with check.autocast(precision):
                # HF shifts the labels inside (it scores tgt-1 tokens per row); the same work
                out = model(input_ids=inputs, mems=mems[0], labels=inputs)
            loss = out.losses.float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.25)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mems[0] = out.mems
            return loss.detach()

        return step
    optimizer = build_optimizer("adam", params, lr=2.5e-4, weight_decay=0.0)  # what `txl train` runs
    state = [Memory.zeros(shape.n_layer, batch, shape.mem_len, shape.d_model, device=check.device)]

    def step(precision: str):
        inputs, labels = segment()
        with check.autocast(precision):
            out = model(inputs, memory=state[0], labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state[0] = out.memory
        return out.loss.detach()

    return step


def hf_version(check: Check) -> str | None:
    """transformers' version if TransfoXL imports, else None (the contender is then skipped)."""
    if "hf_version" not in check.__dict__:
        from txl.bench.common import hf_available

        try:
            check.hf_version = hf_available()
        except Exception as err:  # noqa: BLE001 - an old transformers on a new stack can fail in any way
            check.hf_version = None
            check.error("env", "hf import", err)
    return check.hf_version


def unavailable(check: Check, name: str) -> str | None:
    """Why contender `name` cannot run here (None: it can): transformers 4.35.2 missing, or a txl impl
    that txl.nn.attention.registry does not have for full attention (after loading the built-in kernels)."""
    if name not in check.unavailable:
        if name == "hf":
            reason = None if hf_version(check) else "transformers with TransfoXL (4.35.2) is not importable"
        else:
            impl = name.removeprefix("txl-")
            try:
                from txl.nn.attention import registry

                registry.load_builtin_kernels()
                reason = None if ("full", impl) in registry.KERNELS else (
                    f"attention_impl={impl!r} is not registered for attention='full' (txl.nn.attention.registry)")
            except Exception as err:  # noqa: BLE001 - a kernel module that fails to import
                reason = f"the attention kernels do not load ({type(err).__name__}: {err})"
        check.unavailable[name] = reason
    return check.unavailable[name]


def contenders(check: Check, stage: str, names=None) -> list[str]:
    """The contenders of `stage` that can run here; the others are recorded as skipped."""
    chosen = []
    for name in check.args.contenders if names is None else names:
        reason = unavailable(check, name)
        if reason:
            check.skip(stage, name, f"not available: {reason}")
        else:
            chosen.append(name)
    return chosen


def measure(check: Check, stage: str, what: str, row: dict, run) -> bool:
    """Run `run()` (which fills `row`) and keep the row: True if measured. A BudgetSpent or a UsageError
    (what the contender refuses here, e.g. flex training on the CPU) is a skip, not a row; any other
    failure is an error in the row."""
    from txl.errors import UsageError

    try:
        run()
        log(f"{stage} {what}: {describe_row(row)}")
    except BudgetSpent as err:
        check.skip(stage, what, f"time budget: {err}")
        return False
    except UsageError as err:
        check.skip(stage, what, f"not available: {err}")
        return False
    except Exception as err:  # noqa: BLE001 - recorded, the next measurement runs
        row["error"] = check.error(stage, what, err)
    check.result[stage].append(row)
    check.save()
    return "error" not in row


def stage_train(check: Check) -> None:
    args, table, peak = check.args, shapes(), check.result["peak"]
    for shape_name in args.shapes:
        shape = table[shape_name]
        flops = train_flops(shape)
        tokens = shape.batch * shape.tgt_len
        for name in contenders(check, "train"):
            steps = {p: step_estimate_s(flops, name, p, shape.n_layer, peak) for p in args.precisions}
            first = args.precisions[0]
            if not check.fits("train", f"{shape_name} {','.join(args.precisions)} {name}",
                              measurement_s(steps[first], name, "train", args, shape)):
                continue
            try:
                model = build_contender(name, shape, check.device)
                step = make_train_step(name, model, shape, check)
            except Exception as err:  # noqa: BLE001
                message = check.error("train", f"{shape_name} {name} build", err)
                check.result["train"].append({"shape": shape_name, "contender": name, "error": message})
                check.free()
                continue
            params = sum(p.numel() for p in model.parameters())
            for precision in args.precisions:
                what = f"{shape_name} {precision} {name}"
                if precision != first and not check.fits("train", what, measurement_s(steps[precision], name, "train", args)):
                    continue
                row = {"shape": shape_name, "precision": precision, "contender": name, "params": params,
                       "tokens_per_step": tokens, "flops_per_step": flops,
                       "describe": shape.describe() + f"; tgt_len {shape.tgt_len}, mem_len {shape.mem_len}, "
                                                      f"batch {shape.batch}"}
                losses: list = []

                def run(precision=precision, row=row, losses=losses, step=step, tokens=tokens, flops=flops):
                    check.timed(row, lambda: losses.append(step(precision)), tokens=tokens, flops=flops,
                                precision=precision)
                    row["last_loss"] = float(losses[-1])
                    if not math.isfinite(row["last_loss"]):
                        row["error"] = f"loss not finite ({row['last_loss']})"

                measure(check, "train", what, row, run)
            del model, step
            check.free()


def checkpointing_switch(model):
    """How to turn the model's activation checkpointing (each block recomputed in the backward) on and
    off: a function of one bool, or a str saying why there is none. The switch is the model's
    `checkpoint_blocks` attribute, which `train.activation_checkpointing = "blocks"` sets."""
    if not isinstance(getattr(model, "checkpoint_blocks", None), bool):
        return (f"{type(model).__name__} has no activation-checkpointing switch (checkpoint_blocks, "
                "train.activation_checkpointing)")

    def turn(on: bool) -> None:
        model.checkpoint_blocks = on

    return turn


def stage_checkpointing(check: Check) -> None:
    from txl.bench.common import build_ours

    args, table, peak = check.args, shapes(), check.result["peak"]
    impl = auto_impl(args.device)
    name = f"txl-{impl}"
    if not contenders(check, "checkpointing", [name]):
        return
    switch = checkpointing_switch(build_ours(table["micro"], impl))
    if isinstance(switch, str):
        check.skip("checkpointing", name, f"not available: {switch}")
        return
    for shape_name in args.ckpt_shapes:
        shape = table[shape_name]
        flops = train_flops(shape)
        tokens = shape.batch * shape.tgt_len
        steps = {(p, mode): step_estimate_s(flops, name, p, shape.n_layer, peak) * (4 / 3 if mode == "blocks" else 1)
                 for p in args.precisions for mode in ("none", "blocks")}
        first = (args.precisions[0], "none")
        if not check.fits("checkpointing", f"{shape_name} {name}", measurement_s(steps[first], name, "train", args, shape)):
            continue
        try:
            model = build_ours(shape, impl).to(check.device)
            switch = checkpointing_switch(model)
        except Exception as err:  # noqa: BLE001
            check.error("checkpointing", f"{shape_name} {name} build", err)
            check.free()
            continue
        for precision in args.precisions:
            for mode in ("none", "blocks"):
                what = f"{shape_name} {precision} {name} {mode}"
                if (precision, mode) != first and not check.fits("checkpointing", what, measurement_s(
                        steps[precision, mode], name, "train", args)):
                    continue
                row = {"shape": shape_name, "precision": precision, "contender": name, "checkpointing": mode}

                def run(precision=precision, mode=mode, row=row, model=model, switch=switch, shape=shape,
                        tokens=tokens, flops=flops):
                    switch(mode == "blocks")
                    step = make_train_step(name, model, shape, check)  # a fresh optimizer and memory
                    check.timed(row, lambda: step(precision), tokens=tokens, flops=flops, precision=precision)

                measure(check, "checkpointing", what, row, run)
                check.free()
        with contextlib.suppress(Exception):
            switch(False)
        del model
        check.free()


def stage_compile(check: Check) -> None:
    import torch

    from txl.bench.common import build_ours

    args, peak = check.args, check.result["peak"]
    impl = auto_impl(args.device)
    name = f"txl-{impl}"
    if not contenders(check, "compile", [name]):
        return
    shape, precision = shapes()[args.compile_shape], compile_precision(args)
    flops, tokens = train_flops(shape), shape.batch * shape.tgt_len
    backend = args.compile_backend or ("inductor" if check.cuda else "eager")
    reference = next((r for r in check.result["train"] if r["shape"] == shape.name and r.get("precision") == precision
                      and r["contender"] == name and r.get("tokens_per_s")), None)
    if reference is None:  # the same model uncompiled, measured here
        step_s = step_estimate_s(flops, name, precision, shape.n_layer, peak)
        what = f"{shape.name} {precision} {name}"
        if check.fits("compile", what, measurement_s(step_s, name, "train", args, shape)):
            model = build_ours(shape, impl).to(check.device)
            row = {"shape": shape.name, "precision": precision, "contender": name, "backend": "none"}
            step = make_train_step(name, model, shape, check)
            if measure(check, "compile", what, row, lambda: check.timed(row, lambda: step(precision), tokens=tokens,
                                                                         flops=flops, precision=precision)):
                reference = row
            del model, step
            check.free()
    compiled_name = f"{name} compiled"
    step_s = step_estimate_s(flops, compiled_name, precision, shape.n_layer, peak)
    what = f"{shape.name} {precision} {compiled_name}"
    if not check.fits("compile", what, measurement_s(step_s, compiled_name, "train", args, shape) + step_s):
        return
    row = {"shape": shape.name, "precision": precision, "contender": compiled_name, "backend": backend}

    def run():
        model = build_ours(shape, impl).to(check.device)
        step = make_train_step(name, torch.compile(model, backend=backend), shape, check)
        # two warm-up steps at least: the second call recompiles for a memory that is an output
        check.timed(row, lambda: step(precision), tokens=tokens, flops=flops, precision=precision,
                    warmup=max(args.warmup, 2))
        if reference:
            row["x_uncompiled"] = row["tokens_per_s"] / reference["tokens_per_s"]

    measure(check, "compile", what, row, run)
    check.free()


def stage_eval(check: Check) -> None:
    import torch

    from txl.eval.segments import forward_segment
    from txl.nn.memory import Memory

    args, peak = check.args, check.result["peak"]
    shape = shapes()[args.eval_shape]
    batch, tgt = shape.eval_batch, shape.eval_tgt_len
    stream = token_stream(shape, batch, 8 * tgt + 1).to(check.device)
    names = contenders(check, "eval")
    for mem_len in args.eval_mem_lens or shape.eval_mem_lens:
        flops = eval_flops(shape, mem_len)
        for name in names:
            steps = {p: step_estimate_s(flops, name, p, shape.n_layer, peak, "eval") for p in args.precisions}
            first = args.precisions[0]
            if not check.fits("eval", f"{shape.name} mem {mem_len} {','.join(args.precisions)} {name}",
                              measurement_s(steps[first], name, "eval", args, shape)):
                continue
            try:
                model = build_contender(name, shape, check.device, mem_len=mem_len, train=False)
            except Exception as err:  # noqa: BLE001
                check.result["eval"].append({"shape": shape.name, "mem_len": mem_len, "contender": name,
                                             "error": check.error("eval", f"{mem_len} {name} build", err)})
                continue
            for precision in args.precisions:
                what = f"{shape.name} mem {mem_len} {precision} {name}"
                if precision != first and not check.fits("eval", what, measurement_s(steps[precision], name, "eval", args)):
                    continue
                row = {"shape": shape.name, "mem_len": mem_len, "precision": precision, "contender": name}
                position = [0]
                if name == "hf":
                    state = [[torch.zeros(mem_len, batch, shape.d_model, device=check.device)
                              for _ in range(shape.n_layer)]]
                else:
                    state = [Memory.zeros(shape.n_layer, batch, mem_len, shape.d_model, device=check.device)]

                @torch.no_grad()
                def step(precision=precision, name=name, model=model, state=state, position=position, mem_len=mem_len):
                    start = position[0]
                    position[0] = (start + tgt) % (7 * tgt)
                    inputs, labels = stream[:, start : start + tgt], stream[:, start + 1 : start + tgt + 1]
                    with check.autocast(precision):
                        if name == "hf":
                            state[0] = model(input_ids=inputs, mems=state[0], labels=inputs).mems
                        elif name == "txl-fast":  # exactly what `txl eval` runs
                            state[0] = forward_segment(model, inputs, labels, state[0], mem_len=mem_len)[1]
                        else:
                            state[0] = model(inputs, memory=state[0], labels=labels).memory

                measure(check, "eval", what, row, lambda row=row, step=step: check.timed(row, step, tokens=batch * tgt))
            del model
            check.free()


def stage_generate(check: Check) -> None:
    import torch

    from txl.bench.common import build_ours
    from txl.bench.mfu import forward_flops
    from txl.generate.decoder import generate_rerun, stream_tokens

    args, peak = check.args, check.result["peak"]
    shape = shapes()[args.eval_shape]
    context, new = args.context, args.new_tokens
    prompt = torch.randint(0, shape.vocab, (context,), generator=torch.Generator().manual_seed(0))
    wanted = [f"txl-{impl}" for impl in GENERATE_IMPLS if f"txl-{impl}" in args.contenders]
    for name in contenders(check, "generate", wanted):
        impl = name.removeprefix("txl-")
        model = None
        for i, precision in enumerate(args.precisions):
            rerun_s = step_estimate_s(forward_flops(shape, tgt_len=context, mem_len=0, batch=1), name, precision,
                                      shape.n_layer, peak, "eval")
            seconds = (5 * rerun_s + (args.warmup * 8 + new + 1) * LAUNCH_S["token"] * shape.n_layer
                       + (build_estimate_s(shape) if i == 0 else 0))
            if not check.fits("generate", f"{shape.name} context {context} {precision} {name}", seconds):
                continue
            if model is None:
                try:
                    model = build_ours(shape, impl, mem_len=context, train=False).to(check.device)
                except Exception as err:  # noqa: BLE001
                    check.error("generate", f"{impl} build", err)
                    break
            base = {"shape": shape.name, "context": context, "precision": precision, "contender": name}
            try:
                with check.autocast(precision):
                    tokens = stream_tokens(model, prompt, max_new_tokens=args.warmup * 8 + new + 1,
                                           temperature=0.0, mem_len=context)
                    next(tokens)  # the prompt fills the memory
                    for _ in range(args.warmup * 8):
                        next(tokens)
                    check.sync()
                    start = time.perf_counter()
                    for _ in range(new):
                        next(tokens)  # each token is read back to the host (greedy choice): synchronous
                    reuse = (time.perf_counter() - start) / new
                    tokens.close()
                    generate_rerun(model, prompt, max_new_tokens=1)
                    reruns = []
                    for _ in range(3):
                        check.sync()
                        start = time.perf_counter()
                        generate_rerun(model, prompt, max_new_tokens=1)
                        reruns.append(time.perf_counter() - start)
                rerun = statistics.median(reruns)
                rows = [dict(base, mode="memory reuse", tokens_per_s=1 / reuse, ms_per_token=1000 * reuse,
                             x_rerun=rerun / reuse),
                        dict(base, mode="full re-run", tokens_per_s=1 / rerun, ms_per_token=1000 * rerun, x_rerun=1.0)]
                log(f"generate {shape.name} {precision} {name}: {1 / reuse:,.0f} tokens/s with memory, "
                    f"{rerun / reuse:.1f}x a full re-run")
            except Exception as err:  # noqa: BLE001
                rows = [dict(base, error=check.error("generate", f"{precision} {impl}", err))]
            check.result["generate"].extend(rows)
            check.save()
        del model
        check.free()


STAGE_RUNS = {"env": stage_env, "tests": stage_tests, "train": stage_train, "checkpointing": stage_checkpointing,
              "compile": stage_compile, "eval": stage_eval, "generate": stage_generate}


# ---------------------------------------------------------------------------------------------
# Arguments


def csv(choices: tuple[str, ...] | None = None, kind=str):
    def parse(text: str):
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        if choices:
            bad = [v for v in values if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(map(str, bad))}; choose from {', '.join(choices)}")
        return values

    return parse


SHAPE_NAMES = ("tiny", "base", "large", "micro", "micro-adaptive")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line naming the cause (argparse's own adds the whole usage first)."""
        self.exit(2, f"device_check: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog="device_check", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or "device_check_out",
                        help="output folder (default $OUT, else ./device_check_out)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="micro shapes, few steps, small peak matmul: a smoke run of every stage (seconds on a CPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments, write and print the plan with its time estimate, run nothing")
    parser.add_argument("--stages", type=csv(STAGES), default=list(STAGES), help=f"of {','.join(STAGES)}")
    parser.add_argument("--shapes", type=csv(SHAPE_NAMES), default=None, help="training shapes (default tiny,base,large)")
    parser.add_argument("--precisions", type=csv(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--contenders", type=csv(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--ckpt-shapes", type=csv(SHAPE_NAMES), default=None,
                        help="activation checkpointing shapes (default base,large)")
    parser.add_argument("--compile-shape", choices=SHAPE_NAMES, default=None, help="torch.compile shape (default base)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default inductor on CUDA; eager on the CPU: the plumbing only)")
    parser.add_argument("--eval-shape", choices=SHAPE_NAMES, default=None, help="eval/generate shape (default base)")
    parser.add_argument("--eval-mem-lens", type=csv(kind=int), default=None)
    parser.add_argument("--context", type=int, default=None, help="generation context (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=None, help="timed generated tokens (default 64)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps at most (default 10)")
    parser.add_argument("--timed-s", type=float, default=None,
                        help="seconds of timed steps per measurement: fewer steps where a step is slow (default 1.5)")
    parser.add_argument("--peak-n", type=int, default=None, help=f"peak matmul size (default {PEAK_N})")
    parser.add_argument("--peak-reps", type=int, default=10)
    parser.add_argument("--budget-minutes", type=float, default=BUDGET_MINUTES,
                        help="minutes for the whole run from the start of device_check.sh: measurements that "
                             f"would end later are skipped and recorded (default {BUDGET_MINUTES:g})")
    parser.add_argument("--reserve-s", type=float, default=RESERVE_S,
                        help=f"seconds of the budget kept free for overruns (default {RESERVE_S:g})")
    parser.add_argument("--tests-timeout-s", type=float, default=STAGE_S["tests"],
                        help="the CUDA tests' limit (also cut to the time left for the stage)")
    parser.add_argument("--install-wheels", metavar="FOLDER", help="only install FOLDER's wheels into --target, then exit")
    parser.add_argument("--target", default="/tmp/site", help="where --install-wheels installs")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(shapes=["micro", "micro-adaptive"] if quick else ["tiny", "base", "large"],
                    ckpt_shapes=["micro"] if quick else ["base", "large"], compile_shape="micro" if quick else "base",
                    eval_shape="micro" if quick else "base", context=32 if quick else 1024,
                    new_tokens=4 if quick else 64, warmup=1 if quick else 2, reps=2 if quick else 10,
                    timed_s=0.2 if quick else 1.5, peak_n=256 if quick else PEAK_N)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.peak_reps = min(args.peak_reps, 3)
    for key in ("context", "new_tokens", "reps", "peak_n", "peak_reps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    for key in ("budget_minutes", "timed_s"):
        if not getattr(args, key) > 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")
    if args.warmup < 0 or args.reserve_s < 0:
        parser.error(f"--warmup and --reserve-s must be >= 0, got {args.warmup} and {args.reserve_s}")
    if args.reserve_s >= args.budget_minutes * 60:
        parser.error(f"--reserve-s {args.reserve_s:g} leaves nothing of a {args.budget_minutes:g}-minute budget")
    return args


def plan_text(items: list[dict], args: argparse.Namespace) -> str:
    """The plan as lines, with each stage's estimated total against its slice of the budget."""
    totals: dict[str, float] = {}
    for item in items:
        totals[item["stage"]] = totals.get(item["stage"], 0.0) + item["estimate_s"]
    budget = Budget(args.budget_minutes * 60, args.stages, reserve_s=args.reserve_s, spent_s=SETUP_S)
    lines = [f"{item['stage']}: {item['what']} (~{item['estimate_s']:.1f} s)" for item in items]
    lines.append(f"estimate ({'H100 peaks' if args.device == 'cuda' else 'before the peak is measured'}): set-up "
                 f"~{SETUP_S:.0f} s, then " + ", ".join(f"{stage} {totals.get(stage, 0):.0f} s of its "
                                                         f"{budget.slice_s(stage):.0f}" for stage in args.stages)
                 + f"; {sum(totals.values()):.0f} s for the {budget.end - budget.clock():.0f} s that a "
                   f"{args.budget_minutes * 60:.0f}-second budget leaves after the set-up and the {args.reserve_s:.0f}-second "
                   "reserve (what does not fit is skipped and listed)")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, clock=None) -> int:
    global START_UNIX

    args = parse_args(argv)
    if args.install_wheels:
        install_wheels(args.install_wheels, args.target)
        return 0
    sys.path.insert(0, str(ROOT / "src"))  # run from the source tree without installing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from txl.io import write_text

        items = plan(args)
        write_text(out / "device_check.json", json.dumps({"status": "dry run", "args": vars(args), "plan": items},
                                                         indent=2) + "\n")
        print(plan_text(items, args))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: error: --device cuda but torch sees no CUDA device; use --device cpu --quick for "
              "a smoke run on the CPU", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32: TF32 off
    # FlexAttention is compiled for each shape and dtype (dynamic=False): the run's 10 (3 training shapes
    # and 2 memory lengths, 2 precisions) would pass dynamo's default of 8 and fall back to unfused flex
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name and its older alias
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    check = Check(args, clock=clock)
    check.result["env"]["dynamo_recompile_limit"] = getattr(config, "recompile_limit", None)
    START_UNIX = check.result["started_unix"]
    budget = check.budget
    log(f"device check: {args.device}, stages {','.join(args.stages)}, shapes {','.join(args.shapes)}, "
        f"budget {budget.total_s:.0f} s ({budget.elapsed():.0f} s spent before this script), out {out}")
    for stage in args.stages:
        budget.begin(stage)
        started = budget.clock()
        log(f"stage {stage}: {max(budget.left(), 0):.0f} s for it, {max(budget.total_left(), 0):.0f} s of the budget left")
        try:
            STAGE_RUNS[stage](check)
        except Exception as err:  # noqa: BLE001 - one stage's failure never stops the next
            check.error(stage, "stage", err)
        check.result["budget"]["stages"][stage]["used_s"] = budget.clock() - started
        check.save()
    check.result["status"] = "done"
    check.save()
    print(markdown(check.result), flush=True)
    log(f"device check done in {check.result['elapsed_s']:.0f} s; {len(check.result['errors'])} error(s), "
        f"{len(check.result['skipped'])} skipped; summary in {out}/device_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
