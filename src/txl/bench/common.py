"""What every benchmark shares: the configurations, the contenders, fair timing, memory probes, the
machine description and markdown tables.

Fairness rules (issue 6): contenders run in one process and *alternate* step by step, so a noisy
neighbour slows all of them alike; we report medians over timed steps after warm-up, and ratios
measured in the same run. Peak RSS is a per-process high-water mark, so it is measured in a fresh
subprocess per contender (`txl.bench.probe`), never in the alternating run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from txl.errors import UsageError
from txl.io import read_proc, write_text


@dataclass(frozen=True)
class Shape:
    """One benchmark configuration (issue 6, "Configurations")."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    tgt_len: int
    mem_len: int
    batch: int
    vocab: int = 256
    dropout: float = 0.1
    # evaluation: shorter segments, bigger batch, memory swept up to the enwik8-large eval setting
    eval_tgt_len: int = 128
    eval_batch: int = 16
    eval_mem_lens: tuple[int, ...] = (128, 512, 1600, 3800)
    extra: tuple[tuple[str, Any], ...] = ()  # further model keys (a preset's cutoffs, div_val, dropatt...)

    def model_config(self, **overrides):
        from txl.models.transformer_xl.config import TransformerXLConfig

        values = dict(
            vocab_size=self.vocab, n_layer=self.n_layer, d_model=self.d_model, n_head=self.n_head,
            d_head=self.d_head, d_inner=self.d_inner, mem_len=self.mem_len, dropout=self.dropout, dropatt=0.0,
        )
        values.update({key: list(value) if isinstance(value, tuple) else value for key, value in self.extra})
        values.update(overrides)
        return TransformerXLConfig(**values)

    def describe(self) -> str:
        extra = "".join(f", {key} {list(value) if isinstance(value, tuple) else value}" for key, value in self.extra)
        return (f"{self.n_layer} layers, d_model {self.d_model}, {self.n_head}×{self.d_head} heads, "
                f"d_inner {self.d_inner}, vocab {self.vocab}, dropout {self.dropout}{extra}")


def preset_shape(preset: str, vocab: int) -> Shape:
    """A training preset's model, segment, memory and batch as a benchmark shape (random tokens from a
    vocabulary of its corpus's size), so `txl bench train/mfu --config PRESET` times the shape that
    preset trains. Every value comes from the preset as `txl train` resolves it (defaults included)."""
    from txl.train.config import build_run_config

    run = build_run_config(preset=preset)
    config = run.model_config(vocab_size=vocab)
    core = ("n_layer", "d_model", "n_head", "d_head", "d_inner", "mem_len")
    extra = tuple(sorted((key, tuple(v) if isinstance(v := getattr(config, key), list | tuple) else v)
                         for key in run.model if key not in (*core, "dropout")))
    train = run.train
    return Shape(preset, **{key: getattr(config, key) for key in core}, tgt_len=train.tgt_len,
                 batch=train.batch_size, vocab=vocab, dropout=config.dropout,
                 eval_tgt_len=train.eval_tgt_len or train.tgt_len, eval_batch=train.eval_batch_size,
                 eval_mem_lens=(config.mem_len,), extra=extra)


SHAPES: dict[str, Shape] = {
    "tiny": Shape("tiny", n_layer=4, d_model=128, n_head=4, d_head=32, d_inner=512, tgt_len=128, mem_len=128,
                  batch=8, eval_tgt_len=128, eval_batch=8, eval_mem_lens=(128, 512, 1600, 3800)),
    # the enwik8-base shape of Dai et al. 2019
    "base": Shape("base", n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=512, mem_len=512,
                  batch=2, eval_tgt_len=128, eval_batch=16, eval_mem_lens=(128, 512, 1600, 3800)),
}
# Presets `--config` also takes (the CPU-hour presets and the ones they replace, issue 23), with their
# corpora's vocabulary sizes; their shapes are read from the preset files when first asked for.
PRESET_VOCABS = {"ptb-char-small": 50, "ptb-word-small": 10_000, "ptb-char-hour": 50, "ptb-word-hour": 10_000}
CONFIG_NAMES = (*SHAPES, *PRESET_VOCABS)


def shape_named(name: str) -> Shape:
    """A `--config` name's shape: a built-in one, or a preset's (read once, then kept in SHAPES)."""
    if name not in SHAPES and name in PRESET_VOCABS:
        SHAPES[name] = preset_shape(name, PRESET_VOCABS[name])
    if name not in SHAPES:
        raise UsageError(f"unknown bench config {name!r}; choose one of {', '.join(CONFIG_NAMES)}")
    return SHAPES[name]


@dataclass
class BenchOptions:
    """Options shared by every benchmark (the `txl bench` flags)."""

    config: str = "tiny"
    precision: str = "fp32"
    against: tuple[str, ...] = ()  # ("hf",) to add Hugging Face TransfoXL
    impls: tuple[str, ...] = ("eager", "fast")
    warmup: int = 2
    steps: int = 5
    threads: int = 0  # 0 = torch's default
    mem_lens: tuple[int, ...] = ()  # eval: () = the shape's sweep
    rss: bool = True  # measure peak RSS in subprocesses
    quick: bool = False
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> Shape:
        return shape_named(self.config)

    def with_(self, **changes) -> BenchOptions:
        return replace(self, **changes)


def check_precision(precision: str) -> None:
    if precision not in ("fp32", "bf16"):
        raise UsageError(f"--precision must be fp32 or bf16, got {precision!r}")


def setup_torch(options: BenchOptions) -> None:
    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)


def autocast(precision: str):
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


# ---------------------------------------------------------------------------------------------
# Contenders: ours with a given attention_impl ("eager" = the whole reference: eager kernel and the
# reference backend; "fast" = the fast kernel and the fast backend), and Hugging Face TransfoXL.


def hf_available() -> str | None:
    """The installed transformers version if it still has TransfoXL (<= 4.35.x works), else None."""
    try:
        import transformers
    except ImportError:
        return None
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import TransfoXLConfig, TransfoXLLMHeadModel  # noqa: F401
    except ImportError:
        return None
    return transformers.__version__


def require_hf() -> str:
    version = hf_available()
    if version is None:
        raise UsageError(
            "--against hf needs Hugging Face transformers with TransfoXL: pip install 'txl[bench]' "
            "(transformers==4.35.2)"
        )
    return version


def build_ours(shape: Shape, impl: str, *, mem_len: int | None = None, train: bool = True):
    import torch

    from txl.models.transformer_xl.model import TransformerXL

    torch.manual_seed(0)
    config = shape.model_config(attention_impl=impl, backend="reference" if impl == "eager" else "auto",
                                mem_len=shape.mem_len if mem_len is None else mem_len)
    return TransformerXL(config).train(train)


def build_hf(shape: Shape, *, mem_len: int | None = None, tgt_len: int | None = None, train: bool = True):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import TransfoXLConfig, TransfoXLLMHeadModel

        if any(key != "dropatt" for key, _ in shape.extra):
            raise UsageError(f"--against hf mirrors plain shapes only; {shape.name} also sets "
                             f"{', '.join(key for key, _ in shape.extra)}")
        torch.manual_seed(0)
        config = TransfoXLConfig(
            vocab_size=shape.vocab, n_layer=shape.n_layer, d_model=shape.d_model, d_embed=shape.d_model,
            n_head=shape.n_head, d_head=shape.d_head, d_inner=shape.d_inner,
            mem_len=shape.mem_len if mem_len is None else mem_len, tgt_len=tgt_len or shape.tgt_len,
            cutoffs=[], div_val=1, dropout=shape.dropout, dropatt=0.0, clamp_len=-1, untie_r=False,
            same_length=False,
        )
        model = TransfoXLLMHeadModel(config).train(train)
    # Under bf16 autocast HF's adaptive-softmax criterion mixes dtypes in an index_put and fails
    # (transformers 4.35.2); run it in fp32 as our head does its softmax (a 256-way softmax: cheap).
    crit = model.crit.forward

    def crit_fp32(hidden, labels=None, keep_order=False):
        with torch.autocast(hidden.device.type, enabled=False):  # on CUDA too (scripts/device_check.py)
            return crit(hidden.float(), labels, keep_order)

    model.crit.forward = crit_fp32
    return model


def contender_names(options: BenchOptions) -> list[str]:
    names = [f"txl-{impl}" for impl in options.impls]
    if "hf" in options.against:
        require_hf()
        names.append("hf")
    return names


# ---------------------------------------------------------------------------------------------
# Timing


def interleaved_medians(steps: dict[str, Callable[[], object]], *, warmup: int, timed: int) -> dict[str, dict]:
    """Run each callable `warmup` times, then `timed` rounds of one call each in turn; per name the
    median, min and all step times in seconds."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(timed):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(t), "min_s": min(t), "times_s": [round(x, 6) for x in t]}
        for name, t in times.items()
    }


def rss_mb() -> float:
    """Current resident set size of this process in MiB."""
    try:
        pages = int(read_proc("/proc/self/statm").split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB.

    Linux: VmHWM of /proc/self/status. Not `ru_maxrss`, which after fork + exec keeps the parent's
    high-water mark when that is larger (the kernel carries it over at exec).
    """
    try:
        for line in read_proc("/proc/self/status").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def probe(kind: str, payload: dict, timeout: float = 1800) -> dict:
    """Run `python -m txl.bench.probe KIND JSON` in a fresh process and return its JSON answer."""
    cmd = [sys.executable, "-m", "txl.bench.probe", kind, json.dumps(payload)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"bench probe {kind} {payload} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The machine


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        text = read_proc("/proc/cpuinfo")
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "amx_bf16", "amx_int8", "amx_tile")
        info["flags"] = [f for f in wanted if f in flags]
    except OSError:
        pass
    info["cpu_capability"] = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    with contextlib.suppress(OSError):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    version = hf_available()
    if version:
        info["transformers"] = version
    from txl.allocator import freed_memory_kept

    info["allocator"] = ("glibc, freed memory kept (txl's default, txl/allocator.py)" if freed_memory_kept()
                         else "the C library's defaults")
    return info


def machine_markdown(info: dict[str, Any]) -> str:
    flags = ", ".join(info.get("flags", [])) or "?"
    lines = [
        f"- CPU: {info.get('cpu')} ({info.get('cores')} logical cores), flags: {flags}; "
        f"torch CPU capability {info.get('cpu_capability')}",
        f"- torch {info.get('torch')}, {info.get('threads')} threads; Python {info.get('python')}; "
        f"transformers {info.get('transformers', 'not installed')}",
        f"- {info.get('platform')}; load average at start {info.get('load_average')}",
        f"- allocator: {info.get('allocator', '?')}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Output


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if value is None:
        return "–"
    return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]] | None = None) -> str:
    """Rows of dicts -> a markdown table; `columns` = [(key, header)] (default: keys of the first row)."""
    if not rows:
        return "(no rows)"
    columns = columns or [(k, k) for k in rows[0]]
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join([head, sep, *body])


def write_json(path: str | Path, result: dict) -> None:
    """`--json FILE` and the reports: created by txl (txl.io), never written through a link planted there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(result, indent=2, sort_keys=False) + "\n")  # keys in the order measured


def options_dict(options: BenchOptions) -> dict:
    data = asdict(options)
    data.pop("extra", None)
    return data
