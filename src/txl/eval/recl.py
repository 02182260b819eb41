"""Relative effective context length (RECL), Dai et al. 2019 §4.3 and appendix C.

The definition, as the paper's appendix C gives it. A model group M = {m_1 … m_N}; l_i(c, t) is the
loss of m_i on token t with context length c, -log P(x_t | x_{t-1}, …, x_{t-c}). For a short context
c and a long one c' >= c:

    b(c, t)    = min_i l_i(c, t)                                    baseline: the group's best at c
    f_i(c, c') = 1/|T| Σ_{t ∈ T} min(b(c, t), l_i(c', t))           only gains below the baseline count
    T          = the top-r fraction of positions t by b(c, t)        the hardest tokens at context c
    g_i(c, c') = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)    relative perplexity reduction

and RECL_i is found with a step Δ: start at c, c' = c + Δ; while g_i(c, c') >= 0.01 move on
(c = c', c' = c + Δ); return the first c whose gain falls below the threshold. Here the steps are the
consecutive values of `contexts`. When every step still gains, the answer is censored: RECL is at least
the last context (reported as ">= c"). Note f_i(c, c) = mean of b over T for every model, because
b(c, t) <= l_i(c, t): all models are measured against the same baseline, which is the point of RECL.

How l_i(c, t) is obtained for a Transformer-XL (docs/guide/evaluation.md, "Relative effective context length", has the reasoning):

- mode "window" (default, the definition literally): a fresh forward over exactly the c previous tokens,
  no memory, scoring only the last one (`txl.eval.vanilla.context_nll`). Nothing outside the c tokens can
  reach the prediction. Costs one forward of c tokens per scored position, so positions are sampled.
- mode "memory" (the paper's "attention length"): segments with memory mem_len = c and same_length,
  so every query attends to exactly c keys per layer; lower layers' memories carry older information,
  so the reach is up to n_layer × c. One ordinary evaluation pass per c.

Both modes score the same positions for every model and context: targets t >= max(contexts), so
every context is complete, evenly spaced over the split when `positions` is set.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txl.errors import DataError, OutputError, UsageError, describe_os_error
from txl.io import open_regular, save_array, write_figure

THRESHOLD = 0.01  # the paper's gain threshold (appendix C)
MODES = ("window", "memory")


# ---------------------------------------------------------------------------------------------
# The metric, on per-token losses


def top_r(baseline: np.ndarray, r: float) -> np.ndarray:
    """Indices of the ceil(r × n) positions with the largest baseline loss (ties: earlier first)."""
    if not 0.0 < r <= 1.0:
        raise UsageError(f"r must be in (0, 1], got {r}")
    k = max(1, math.ceil(r * len(baseline) - 1e-9))
    return np.argsort(-baseline, kind="stable")[:k]


@dataclass
class ReclResult:
    names: list[str]
    contexts: list[int]
    rs: list[float]
    threshold: float
    recl: dict[str, dict[float, int]]  # name -> r -> RECL (the last context when censored)
    censored: dict[str, dict[float, bool]]  # True: still gaining at the last context (RECL >= value)
    gains: dict[str, dict[float, list[float]]]  # name -> r -> g_i(c_j, c_{j+1}) for every step j
    unnormalized: dict[str, dict[float, list[float]]]  # exp f(c, c) - exp f_i(c, c') (paper's Fig. 3)
    mean_loss: dict[str, list[float]]  # name -> mean loss (nats) over all positions at each context
    positions: int = 0
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        def keyed(d):
            return {name: {str(r): v for r, v in per.items()} for name, per in d.items()}

        return {"names": self.names, "contexts": self.contexts, "r": self.rs, "threshold": self.threshold,
                "recl": keyed(self.recl), "censored": keyed(self.censored), "gains": keyed(self.gains),
                "unnormalized_gains": keyed(self.unnormalized), "mean_loss": self.mean_loss,
                "positions": self.positions, **self.info}


def compute_recl(
    losses: dict[str, dict[int, np.ndarray]],
    contexts: Sequence[int],
    rs: Sequence[float] = (0.1, 0.5, 1.0),
    *,
    threshold: float = THRESHOLD,
) -> ReclResult:
    """RECL of every model of the group from per-token losses `losses[name][c]` (nats, the same
    positions in the same order for every model and context)."""
    contexts = [int(c) for c in contexts]
    if len(contexts) < 2 or any(b <= a for a, b in zip(contexts, contexts[1:])):
        raise UsageError(f"contexts must be at least two increasing lengths, got {contexts}")
    names = list(losses)
    if not names:
        raise UsageError("RECL needs at least one model")
    n = None
    for name in names:
        missing = [c for c in contexts if c not in losses[name]]
        if missing:
            raise UsageError(f"no losses for model {name!r} at context {missing[0]}")
        for c in contexts:
            size = len(losses[name][c])
            if n is None:
                n = size
            if size != n or size == 0:
                raise UsageError("every model and context needs losses on the same (non-empty) positions")
    recl: dict[str, dict[float, int]] = {name: {} for name in names}
    censored: dict[str, dict[float, bool]] = {name: {} for name in names}
    gains: dict[str, dict[float, list[float]]] = {name: {} for name in names}
    unnormalized: dict[str, dict[float, list[float]]] = {name: {} for name in names}
    for r in rs:
        for name in names:
            gains[name][r], unnormalized[name][r] = [], []
        for c, c_long in zip(contexts, contexts[1:]):
            baseline = np.min(np.stack([np.asarray(losses[m][c], np.float64) for m in names]), axis=0)
            chosen = top_r(baseline, r)
            f_short = float(np.mean(baseline[chosen]))  # f_i(c, c): the same for every model
            for name in names:
                long = np.asarray(losses[name][c_long], np.float64)[chosen]
                f_long = float(np.mean(np.minimum(baseline[chosen], long)))
                gains[name][r].append((math.exp(f_short) - math.exp(f_long)) / math.exp(f_short))
                unnormalized[name][r].append(math.exp(f_short) - math.exp(f_long))
        for name in names:
            # the paper's search: the first c whose step to c + Δ gains less than the threshold
            step = next((j for j, g in enumerate(gains[name][r]) if g < threshold), None)
            recl[name][r] = contexts[step] if step is not None else contexts[-1]
            censored[name][r] = step is None
    mean_loss = {name: [float(np.mean(losses[name][c], dtype=np.float64)) for c in contexts] for name in names}
    return ReclResult(names=names, contexts=contexts, rs=[float(r) for r in rs], threshold=threshold, recl=recl,
                      censored=censored, gains=gains, unnormalized=unnormalized, mean_loss=mean_loss,
                      positions=int(n))


# ---------------------------------------------------------------------------------------------
# Per-token losses at each context length


NPY_HEADER_LIMIT = 1 << 16  # bytes of a cached .npy's header (numpy writes ~128)


def choose_positions(n_tokens: int, max_context: int, count: int = 0, *, max_tokens: int = 0) -> np.ndarray:
    """Targets t (indices into the split) scored for RECL: every t in [max_context, last], or `count`
    of them evenly spaced. last = n_tokens - 1 (or max_tokens when set)."""
    last = n_tokens - 1 if not max_tokens else min(n_tokens - 1, max_tokens)
    if last < max_context:
        raise UsageError(f"the split has {n_tokens:,} tokens{' (capped by --max-tokens)' if max_tokens else ''}: "
                         f"too few to score any token with a full context of {max_context}; use shorter --contexts")
    span = last - max_context + 1
    if not count or count >= span:
        return np.arange(max_context, last + 1, dtype=np.int64)
    return np.unique(np.linspace(max_context, last, count).round().astype(np.int64))


def context_losses(
    model,
    tokens: np.ndarray,
    positions: np.ndarray,
    contexts: Sequence[int],
    *,
    mode: str = "window",
    tgt_len: int = 128,
    batch_size: int = 0,
    device="cpu",
    precision: str = "fp32",
    cache: Path | None = None,
    cache_key: str = "",
    log=None,
    max_context: int | None = None,
) -> dict[int, np.ndarray]:
    """l(c, t) for t in `positions` and each c in `contexts` (see the module docstring for the modes).
    With `cache` (a directory), each context's losses are stored as .npy and reused on the next run.
    `max_context` (window mode): the model reads at most this many previous tokens, so l(c, t) =
    l(max_context, t) for longer c (a vanilla Transformer's fixed context; see `fixed_context`)."""
    import torch

    from txl.eval.precision import resolve_precision
    from txl.eval.segments import evaluate
    from txl.eval.vanilla import context_nll

    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    arch = getattr(getattr(model, "module", model), "config", None)
    arch = getattr(arch, "arch", None)
    if mode == "memory" and arch in ("lstm", "sha-rnn"):
        raise UsageError(f"mode 'memory' measures a Transformer's attention length (same_length); this model is "
                         f"arch={arch!r}: use --mode window (a fresh forward over the c tokens)")
    out: dict[int, np.ndarray] = {}
    for asked in contexts:
        c = asked if max_context is None or mode != "window" else min(asked, max_context)
        if c in out:  # a fixed context: the longer windows are the same window
            out[asked] = out[c]
            continue
        path = None
        if cache is not None:
            used = resolve_precision(precision, torch.device(device))  # `auto` keyed by what it became
            digest = hashlib.sha256(f"{cache_key}|{mode}|{c}|{tgt_len}|{batch_size}|{used}".encode())
            digest.update(np.ascontiguousarray(positions, dtype=np.int64).tobytes())
            path = Path(cache) / f"losses-{mode}-c{c}-{digest.hexdigest()[:16]}.npy"
            if path.exists() or path.is_symlink():  # (a link is refused by name, not skipped)
                out[c] = _read_cached(path, len(positions))
                continue
        start = time.perf_counter()
        if mode == "window":
            values = context_nll(model, tokens, positions, context_len=c, batch_size=batch_size, device=device,
                                 precision=precision)
        else:
            last = int(positions.max())
            per_token = np.zeros(last, dtype=np.float32)
            evaluate(model, tokens[: last + 1], metric="bpc", batch_size=batch_size or 1, tgt_len=tgt_len,
                     mem_len=c, warm_memory=True, device=device, precision=precision, per_token=per_token,
                     same_length=True)
            values = per_token[positions - 1]
        out[c] = np.asarray(values, dtype=np.float32)
        out[asked] = out[c]
        if log is not None:
            log(f"context {c}: mean loss {float(np.mean(out[c])):.4f} nats over {len(positions):,} positions "
                f"({time.perf_counter() - start:.1f} s)")
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_array(path, out[c])
            except OSError as err:
                raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    return out


ABSOLUTE_POSITIONS = ("sinusoidal", "learned")


def fixed_context(config, train_tgt_len: int | None) -> int | None:
    """The context a vanilla Transformer reads: absolute positions and no memory (Al-Rfou et al. 2018)
    mean a fixed window of the training segment length; longer windows put positions it never saw in
    front of the prediction (its losses then explode, and RECL's min() over noisy losses would read that
    as gains). The paper's vanilla RECL is its training length for this reason. None: no fixed context
    (relative positions, memory, or a recurrent model)."""
    if getattr(config, "arch", "decoder") != "decoder" or getattr(config, "mem_len", 1) or not train_tgt_len:
        return None
    return train_tgt_len if getattr(config, "pos_encoding", None) in ABSOLUTE_POSITIONS else None


def _read_cached(path: Path, n: int) -> np.ndarray:
    """A cached loss vector; a damaged one (truncated, wrong shape or dtype, not finite) is an error that
    names the file, as for a damaged prepared corpus, rather than a number silently trusted."""
    # a regular file no larger than n float64 values and a header: a FIFO would wait for ever, a header
    # claiming gigabytes on a sparse file would be read into memory
    with open_regular(path, what="cached losses", error=DataError, limit=n * 8 + NPY_HEADER_LIMIT) as f:
        try:
            values = np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            values = None
    if values is None or values.shape != (n,) or values.dtype.kind != "f" or not np.isfinite(values).all():
        raise DataError(f"cached losses {path} are damaged (expected {n} finite float values); delete the file "
                        "(or the whole --cache directory) and run again to recompute them")
    return values


def weights_key(directory: Path) -> str:
    """A stable identity for a checkpoint's weights: the SHA-256 recorded in its safetensors metadata
    (falls back to the file's size and mtime)."""
    from txl.models.pretrained import DIGEST_KEY, WEIGHTS_NAME

    path = Path(directory) / WEIGHTS_NAME
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            digest = (f.metadata() or {}).get(DIGEST_KEY)
        if digest:
            return digest
    except Exception:  # a damaged file has already failed to load as a model; this is only a cache key
        pass
    st = path.stat()
    return f"{st.st_size}-{st.st_mtime_ns}"


# ---------------------------------------------------------------------------------------------
# Reports


def _fmt_recl(result: ReclResult, name: str, r: float) -> str:
    value = result.recl[name][r]
    return f">= {value}" if result.censored[name][r] else str(value)


def recl_markdown(result: ReclResult, *, metric: str = "ppl") -> str:
    """The RECL table (as the paper's Table 8), the per-context metric, and the gains at the first r."""
    lines = ["| model | " + " | ".join(f"RECL r = {r:g}" for r in result.rs) + " |",
             "|---|" + "---:|" * len(result.rs)]
    for name in result.names:
        lines.append(f"| {name} | " + " | ".join(_fmt_recl(result, name, r) for r in result.rs) + " |")
    fixed = result.info.get("fixed_context") or {}
    if fixed:
        lines += ["", "Fixed context (absolute positions, no memory: a vanilla Transformer reads at most its training "
                  "segment): " + ", ".join(f"{name} {cap}" for name, cap in fixed.items())
                  + "; longer contexts repeat its loss at that length (`--vanilla-context full` feeds them whole)."]
    from txl.eval.result import metric_value

    lines += ["", f"{metric} at each context length (all {result.positions:,} scored positions):", "",
              "| model | " + " | ".join(str(c) for c in result.contexts) + " |",
              "|---|" + "---:|" * len(result.contexts)]
    for name in result.names:
        values = [metric_value(v, metric) for v in result.mean_loss[name]]
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    r0 = result.rs[0]
    steps = [f"{a}→{b}" for a, b in zip(result.contexts, result.contexts[1:])]
    lines += ["", f"relative gain g(c, c') at r = {r0:g} (RECL stops at the first step below "
              f"{result.threshold:g}):", "", "| model | " + " | ".join(steps) + " |", "|---|" + "---:|" * len(steps)]
    for name in result.names:
        lines.append(f"| {name} | " + " | ".join(f"{g:.4f}" for g in result.gains[name][r0]) + " |")
    return "\n".join(lines) + "\n"


def plot_recl(result: ReclResult, path: str | Path, *, metric: str = "ppl") -> Path:
    """Two panels like the paper's Fig. 4 (metric against context) and Fig. 3 (unnormalized gains)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from txl.eval.report import plain
    from txl.eval.result import metric_value

    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    r0 = result.rs[0]
    for name in result.names:
        label = plain(name)  # checkpoint labels are run names or --names: drawn as written, never as mathtext
        left.plot(result.contexts, [metric_value(v, metric) for v in result.mean_loss[name]], "o-", label=label)
        right.plot(result.contexts[1:], result.unnormalized[name][r0], "o-", label=label)
    left.set_xlabel("context length c")
    left.set_ylabel(metric)
    left.set_title(f"{metric} against context length")
    right.set_xlabel("long context c' (step from the previous c)")
    right.set_ylabel("exp f(c, c) − exp f_i(c, c')")
    right.set_title(f"unnormalized relative gains, r = {r0:g}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return write_figure(fig, path, dpi=120)


__all__ = [
    "ReclResult",
    "choose_positions",
    "compute_recl",
    "context_losses",
    "plot_recl",
    "recl_markdown",
    "top_r",
]
