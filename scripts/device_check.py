"""Device check (issue 46 item 6): what txl does on one CUDA GPU, measured in one run of a few minutes.

    bash scripts/device_check.sh OUT_DIR            # on the GPU machine (installs .whl/, then runs this)
    python3 scripts/device_check.py OUT_DIR --device cpu --quick   # the same code on a CPU, seconds

Stages, each guarded (a failure is recorded in the summary and the next stage runs):

1. env:      GPU name, capability, memory, torch / CUDA / cuDNN / transformers versions, and the
             measured matmul peak (PEAK_N³ products: bf16, fp32 with TF32 off, and TF32 for reference).
2. tests:    `pytest -m cuda tests/test_cuda.py` in a subprocess (its verdicts, and the differences
             the tests measured, from TXL_CUDA_REPORT).
3. train:    training-step throughput (forward, backward, clip 0.25, Adam) of txl (eager and fast
             impls) and Hugging Face TransfoXLLMHeadModel 4.35.2 at the tiny, enwik8-base and
             wt103-large-like shapes, in bf16 autocast and fp32 (TF32 off), with peak GPU memory and
             MFU against the measured peak of the same precision.
   eval:     evaluation throughput (no grad, memory carried) at the base shape for two memory lengths.
   generate: greedy generation with memory at the base shape (context 1024), against re-running it.
4. summary:  OUT_DIR/device_check.json and OUT_DIR/device_check.md, rewritten after every
             measurement, so a run cut short still leaves what it measured.

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
STAGES = ("env", "tests", "train", "eval", "generate")
PRECISIONS = ("bf16", "fp32")
CONTENDERS = ("txl-eager", "txl-fast", "hf")
# The wheels for the Hugging Face comparison (.whl/, see scripts/device_check.sh): these three always
# (the machine's own transformers has no TransfoXL any more); the others only where the machine lacks
# them, so that nothing the machine's torch relies on is shadowed.
ALWAYS = ("transformers", "tokenizers", "huggingface_hub")
MODULE_OF = {"pyyaml": "yaml"}  # distribution -> import name, where they differ
PEAK_N = 8192
WT103_VOCAB = 267_735


def log(message: str) -> None:
    """One progress line with the wall-clock time (the caller's output is unbuffered)."""
    now = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{now}] {message}", flush=True)


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
# Summary


def add_ratios(rows: list[dict], group: tuple[str, ...]) -> None:
    """x_hf (tokens/s over Hugging Face's) and x_eager (over txl-eager's) for rows that share `group`."""
    by_group: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("tokens_per_s"):
            by_group.setdefault(tuple(row.get(k) for k in group), {})[row["contender"]] = row
    for row in rows:
        peers = by_group.get(tuple(row.get(k) for k in group), {})
        for reference, key in (("hf", "x_hf"), ("txl-eager", "x_eager")):
            if row.get("tokens_per_s") and reference in peers and row.get("mode") == peers[reference].get("mode"):
                row[key] = row["tokens_per_s"] / peers[reference]["tokens_per_s"]


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
                 f"{len(result.get('errors', []))} error(s)")
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
        rows = [dict(r, peak_gib=r.get("peak_gib"), mfu=None if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%")
                for r in train]
        lines += ["", "## Training throughput (forward + backward + clip + Adam)", "",
                  markdown_table(rows, [("shape", "shape"), ("precision", "precision"), ("contender", "contender"),
                                        ("tokens_per_s", "tokens/s"), ("step_ms", "step ms"),
                                        ("peak_gib", "peak GiB"), ("tflops", "model TFLOP/s"), ("mfu", "MFU"),
                                        ("x_hf", "× HF"), ("x_eager", "× eager"), ("error", "error")])]
        described = {r["shape"]: r.get("describe") for r in train if r.get("describe")}
        lines += [""] + [f"- {name}: {text}" for name, text in described.items()]
    evaluation = result.get("eval", [])
    if evaluation:
        lines += ["", "## Evaluation throughput (no grad, memory carried)", "",
                  markdown_table(evaluation, [("shape", "shape"), ("mem_len", "mem_len"), ("precision", "precision"),
                                              ("contender", "contender"), ("tokens_per_s", "tokens/s"),
                                              ("peak_gib", "peak GiB"), ("x_hf", "× HF"), ("x_eager", "× eager"),
                                              ("error", "error")])]
    generation = result.get("generate", [])
    if generation:
        lines += ["", "## Generation with memory (batch 1, greedy)", "",
                  markdown_table(generation, [("shape", "shape"), ("context", "context"), ("precision", "precision"),
                                              ("contender", "contender"), ("mode", "mode"), ("tokens_per_s", "tokens/s"),
                                              ("ms_per_token", "ms/token"), ("x_rerun", "× re-run"),
                                              ("x_eager", "× eager"), ("error", "error")])]
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
    result["elapsed_s"] = time.time() - result["started_unix"]
    write_text(out / "device_check.json", json.dumps(result, indent=2, default=str) + "\n")
    write_text(out / "device_check.md", markdown(result))


# ---------------------------------------------------------------------------------------------
# The run


class Check:
    """The state of one run: arguments, device, results and the time left."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.out = Path(args.out)
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.time() + args.budget_s
        self.result = {
            "status": "running", "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "started_unix": time.time(), "args": vars(args), "env": {}, "peak": {}, "train": [], "eval": [],
            "generate": [], "errors": [],
            "flops_formula": ("model FLOPs of a training step = 3 × forward (txl.bench.mfu.forward_flops: per "
                              "layer q, k/v over memory + segment, output, FFN, position projection and 3 "
                              "score products; 2 FLOPs per multiply-add), i.e. 6 · non-embedding params · "
                              "tokens + attention; the head 2·d·V per token, or its expected cost under an "
                              "adaptive softmax; MFU = that / median step time / matmul peak of the precision"),
        }

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        write_summary(self.result, self.out)

    def error(self, stage: str, what: str, err: BaseException) -> str:
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:400]
        frames = traceback.extract_tb(err.__traceback__)[-3:]
        where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
        self.result["errors"].append({"stage": stage, "what": what, "error": message, "where": where})
        log(f"ERROR {stage} / {what}: {message} ({where})")
        return message

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

    def time_steps(self, step, *, warmup: int, reps: int) -> list[float]:
        """Seconds per call of `step` after `warmup` calls: CUDA events on a GPU, else the wall clock."""
        import torch

        for _ in range(warmup):
            step()
        self.sync()
        if not self.cuda:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        self.sync()
        return [start.elapsed_time(end) / 1000 for start, end in events]

    def autocast(self, precision: str):
        import torch

        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


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
                times = check.time_steps(lambda a=a, b=b: a @ b, warmup=2, reps=check.args.peak_reps)
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
    timeout = max(30.0, min(check.args.tests_timeout_s, check.left() - 60))
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


# --- stage 3: throughput ---------------------------------------------------------------------------


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
    """transformers' version if TransfoXL imports, else None; why not is recorded once."""
    if "hf_version" not in check.__dict__:
        from txl.bench.common import hf_available

        try:
            check.hf_version = hf_available()
            if check.hf_version is None:
                check.result["errors"].append({"stage": "env", "what": "hf", "where": "", "error": (
                    "transformers with TransfoXL (4.35.2) is not importable: no Hugging Face rows")})
        except Exception as err:  # noqa: BLE001 - an old transformers on a new stack can fail in any way
            check.hf_version = None
            check.error("env", "hf import", err)
    return check.hf_version


def contenders(check: Check) -> list[str]:
    names = list(check.args.contenders)
    if "hf" in names and hf_version(check) is None:
        names.remove("hf")
    return names


def stage_train(check: Check) -> None:
    table = shapes()
    peak = check.result["peak"]
    for shape_name in check.args.shapes:
        shape = table[shape_name]
        flops = train_flops(shape)
        tokens = shape.batch * shape.tgt_len
        for name in contenders(check):
            if check.left() < check.args.reserve_s:
                check.result["errors"].append({"stage": "train", "what": f"{shape_name} {name}",
                                               "error": "skipped: time budget spent", "where": ""})
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
            for precision in check.args.precisions:
                row = {"shape": shape_name, "precision": precision, "contender": name, "params": params,
                       "tokens_per_step": tokens, "flops_per_step": flops,
                       "describe": shape.describe() + f"; tgt_len {shape.tgt_len}, mem_len {shape.mem_len}, "
                                                      f"batch {shape.batch}"}
                try:
                    check.reset_peak()
                    losses = []
                    times = check.time_steps(lambda p=precision, run=step, out=losses: out.append(run(p)),
                                             warmup=check.args.warmup, reps=check.args.reps)
                    median = statistics.median(times)
                    last = float(losses[-1])
                    row.update(tokens_per_s=tokens / median, step_ms=1000 * median, step_ms_all=times,
                               peak_gib=check.peak_gib(), tflops=flops / median / 1e12, last_loss=last)
                    if not math.isfinite(last):
                        row["error"] = f"loss not finite ({last})"
                    if isinstance(peak.get(precision), float):
                        row["mfu"] = flops / median / 1e12 / peak[precision]
                    log(f"train {shape_name} {precision} {name}: {row['tokens_per_s']:,.0f} tokens/s, step "
                        f"{row['step_ms']:.1f} ms, {row['tflops']:.1f} TFLOP/s"
                        + (f", MFU {100 * row['mfu']:.1f}%" if "mfu" in row else "")
                        + (f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""))
                except Exception as err:  # noqa: BLE001
                    row["error"] = check.error("train", f"{shape_name} {precision} {name}", err)
                check.result["train"].append(row)
                check.save()
            del model, step
            check.free()


def stage_eval(check: Check) -> None:
    import torch

    from txl.eval.segments import forward_segment
    from txl.nn.memory import Memory

    shape = shapes()[check.args.eval_shape]
    batch, tgt = shape.eval_batch, shape.eval_tgt_len
    stream = token_stream(shape, batch, 8 * tgt + 1).to(check.device)
    for mem_len in check.args.eval_mem_lens or shape.eval_mem_lens:
        for name in contenders(check):
            if check.left() < check.args.reserve_s / 2:
                check.result["errors"].append({"stage": "eval", "what": f"{mem_len} {name}",
                                               "error": "skipped: time budget spent", "where": ""})
                continue
            try:
                model = build_contender(name, shape, check.device, mem_len=mem_len, train=False)
            except Exception as err:  # noqa: BLE001
                check.result["eval"].append({"shape": shape.name, "mem_len": mem_len, "contender": name,
                                             "error": check.error("eval", f"{mem_len} {name} build", err)})
                continue
            for precision in check.args.precisions:
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

                try:
                    check.reset_peak()
                    times = check.time_steps(step, warmup=check.args.warmup, reps=check.args.reps)
                    median = statistics.median(times)
                    row.update(tokens_per_s=batch * tgt / median, step_ms=1000 * median, peak_gib=check.peak_gib())
                    log(f"eval {shape.name} mem {mem_len} {precision} {name}: {row['tokens_per_s']:,.0f} tokens/s")
                except Exception as err:  # noqa: BLE001
                    row["error"] = check.error("eval", f"{mem_len} {precision} {name}", err)
                check.result["eval"].append(row)
                check.save()
            del model
            check.free()


def stage_generate(check: Check) -> None:
    import torch

    from txl.bench.common import build_ours
    from txl.generate.decoder import generate_rerun, stream_tokens

    shape = shapes()[check.args.eval_shape]
    context, new = check.args.context, check.args.new_tokens
    prompt = torch.randint(0, shape.vocab, (context,), generator=torch.Generator().manual_seed(0))
    for impl in ("eager", "fast"):
        if f"txl-{impl}" not in check.args.contenders:
            continue
        if check.left() < check.args.reserve_s / 4:
            check.result["errors"].append({"stage": "generate", "what": impl, "error": "skipped: time budget spent",
                                           "where": ""})
            continue
        try:
            model = build_ours(shape, impl, mem_len=context, train=False).to(check.device)
        except Exception as err:  # noqa: BLE001
            check.error("generate", f"{impl} build", err)
            continue
        for precision in check.args.precisions:
            base = {"shape": shape.name, "context": context, "precision": precision, "contender": f"txl-{impl}"}
            try:
                with check.autocast(precision):
                    tokens = stream_tokens(model, prompt, max_new_tokens=check.args.warmup * 8 + new + 1,
                                           temperature=0.0, mem_len=context)
                    next(tokens)  # the prompt fills the memory
                    for _ in range(check.args.warmup * 8):
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
                log(f"generate {shape.name} {precision} txl-{impl}: {1 / reuse:,.0f} tokens/s with memory, "
                    f"{rerun / reuse:.1f}x a full re-run")
            except Exception as err:  # noqa: BLE001
                rows = [dict(base, error=check.error("generate", f"{precision} {impl}", err))]
            check.result["generate"].extend(rows)
            check.save()
        del model
        check.free()


STAGE_RUNS = {"env": stage_env, "tests": stage_tests, "train": stage_train, "eval": stage_eval,
              "generate": stage_generate}


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
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, write the plan, run nothing")
    parser.add_argument("--stages", type=csv(STAGES), default=list(STAGES), help=f"of {','.join(STAGES)}")
    parser.add_argument("--shapes", type=csv(SHAPE_NAMES), default=None, help="training shapes (default tiny,base,large)")
    parser.add_argument("--precisions", type=csv(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--contenders", type=csv(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--eval-shape", choices=SHAPE_NAMES, default=None, help="eval/generate shape (default base)")
    parser.add_argument("--eval-mem-lens", type=csv(kind=int), default=None)
    parser.add_argument("--context", type=int, default=None, help="generation context (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=None, help="timed generated tokens (default 64)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--peak-n", type=int, default=None, help=f"peak matmul size (default {PEAK_N})")
    parser.add_argument("--peak-reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="seconds for the whole run: measurements that would start later are skipped")
    parser.add_argument("--reserve-s", type=float, default=20.0,
                        help="a training measurement starts only with this many seconds of budget left")
    parser.add_argument("--tests-timeout-s", type=float, default=150.0)
    parser.add_argument("--install-wheels", metavar="FOLDER", help="only install FOLDER's wheels into --target, then exit")
    parser.add_argument("--target", default="/tmp/site", help="where --install-wheels installs")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(shapes=["micro", "micro-adaptive"] if quick else ["tiny", "base", "large"],
                    eval_shape="micro" if quick else "base", context=32 if quick else 1024,
                    new_tokens=4 if quick else 64, warmup=1 if quick else 3, reps=2 if quick else 8,
                    peak_n=256 if quick else PEAK_N)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.peak_reps = min(args.peak_reps, 3)
    for key in ("context", "new_tokens", "reps", "peak_n", "peak_reps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def plan(args: argparse.Namespace) -> list[str]:
    """What a run with these arguments measures, one line per item."""
    items = []
    if "env" in args.stages:
        items.append(f"env: versions; matmul peak {args.peak_n}^3 in bf16, fp32 (TF32 off)"
                     + (", tf32" if args.device == "cuda" else ""))
    if "tests" in args.stages:
        items.append("tests: pytest -m cuda tests/test_cuda.py")
    if "train" in args.stages:
        items += [f"train: {s} {p} {c}" for s in args.shapes for c in args.contenders for p in args.precisions]
    if "eval" in args.stages:
        mem_lens = args.eval_mem_lens or shapes()[args.eval_shape].eval_mem_lens
        items += [f"eval: {args.eval_shape} mem {m} {p} {c}" for m in mem_lens for c in args.contenders
                  for p in args.precisions]
    if "generate" in args.stages:
        items += [f"generate: {args.eval_shape} context {args.context} {p} {c}" for c in args.contenders
                  if c != "hf" for p in args.precisions]
    return items


def main(argv: list[str] | None = None) -> int:
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
        print("\n".join(items))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: error: --device cuda but torch sees no CUDA device; use --device cpu --quick for "
              "a smoke run on the CPU", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32: TF32 off
    check = Check(args)
    log(f"device check: {args.device}, stages {','.join(args.stages)}, shapes {','.join(args.shapes)}, "
        f"budget {args.budget_s:.0f} s, out {out}")
    for stage in args.stages:
        log(f"stage {stage} ({check.left():.0f} s of budget left)")
        try:
            STAGE_RUNS[stage](check)
        except Exception as err:  # noqa: BLE001 - one stage's failure never stops the next
            check.error(stage, "stage", err)
        check.save()
    check.result["status"] = "done"
    check.save()
    print(markdown(check.result), flush=True)
    log(f"device check done in {check.result['elapsed_s']:.0f} s; {len(check.result['errors'])} error(s); "
        f"summary in {out}/device_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
