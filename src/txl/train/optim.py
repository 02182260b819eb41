"""Optimisers and learning-rate schedules of the reference (and LAMB for large batches, Muon for the
hidden matrices).

The schedule is a pure function of the step, so resuming needs no scheduler state. Optimiser state
is split into tensors (safetensors) and plain values (JSON): nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"): Adam's update rescaled per
    parameter tensor by the trust ratio ||w|| / ||update||, which keeps very large batches stable.
    NVIDIA's Transformer-XL fork uses it for its multi-node runs."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                step = state["step"].item()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = exp_avg / (1 - beta1**step)
                v_hat = exp_avg_sq / (1 - beta2**step)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update.add(p.float(), alpha=group["weight_decay"])
                w_norm, u_norm = p.float().norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update.to(p.dtype), alpha=-group["lr"] * trust.item())
        return loss


def hidden_matrices(model: nn.Module) -> list[Tensor]:
    """The weights Muon orthogonalises: every linear layer's matrix (attention and position projections,
    feed-forward). Embeddings, the (adaptive) softmax head, LayerNorm, biases and the xl biases u, v are
    not linear layers, and a matrix tied to an embedding is left out: Muon is for hidden layers only
    (Jordan et al. 2024)."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    out = []
    for module in model.modules():
        weight = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
        # a (1, d) or (d, 1) weight (the Universal Transformer's halting unit) is a vector: orthogonalising
        # it would only normalise its gradient
        if (weight is not None and weight.requires_grad and weight.ndim == 2 and min(weight.shape) > 1
                and id(weight) not in tied | seen):
            seen.add(id(weight))
            out.append(weight)
    return out


class MuonAdam(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; `torch.optim.Muon`) on the
    hidden weight matrices, AdamW on everything else, as one optimiser: one list of parameter groups
    (each marked `muon`), one state, one state_dict (saved as the others are, nothing pickled).

    Muon scales each matrix's update as Liu et al. 2025 ("Muon is Scalable for LLM Training") do,
    0.2·sqrt(max(rows, cols)), so its update has AdamW's RMS and the Adam learning rate and schedule
    carry over; weight decay is decoupled (AdamW's) on every parameter. The two halves are torch's own optimisers, stepped in turn on
    this optimiser's groups and state (load_state_dict replaces both, so they are re-pointed each step).
    """

    def __init__(self, matrices, others, *, lr: float, weight_decay: float, betas=(0.9, 0.999), eps=1e-8,
                 momentum: float = 0.95):
        matrix_ids = {id(p) for p in matrices}
        others = [p for p in others if id(p) not in matrix_ids]
        parts = []
        if matrices:
            parts.append(torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                          adjust_lr_fn="match_rms_adamw"))
        if others:
            parts.append(_adam(torch.optim.AdamW, others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if not parts:
            raise ValueError("MuonAdam got no parameters")
        groups = []
        for part in parts:
            for group in part.param_groups:
                group["muon"] = isinstance(part, torch.optim.Muon)
                groups.append(group)
        super().__init__(groups, {})
        self._parts = parts

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict) or not isinstance(param_group.get("muon"), bool):
            raise ValueError("a MuonAdam parameter group must say muon=True (2-d matrices) or muon=False, with that "
                             "optimiser's hyperparameters")
        super().add_param_group(param_group)

    def __getstate__(self) -> dict:  # copy.deepcopy keeps the two halves (torch's keeps only groups and state)
        return {**super().__getstate__(), "_parts": self._parts}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts:
            is_muon = isinstance(part, torch.optim.Muon)
            part.param_groups = [g for g in self.param_groups if g["muon"] is is_muon]
            part.state = self.state
            part.step()
        return loss


def _adam(cls, params, *, lr, betas, eps, weight_decay):
    # The fused kernel updates every tensor in one pass (CPU and CUDA): same algorithm, fewer
    # small ops than the per-parameter loop (about 1.5% of a tiny-model step on CPU, measured).
    fused = all(p.device.type in ("cpu", "cuda") for p in params) or None
    try:
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
    except (RuntimeError, ValueError):  # a torch or device without the fused kernel
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def build_optimizer(name: str, model: nn.Module | Iterable[Tensor], *, lr: float, weight_decay: float,
                    betas=(0.9, 0.999), eps=1e-8):
    """`model`: the module to train, or (except for muon, which must tell hidden matrices from the rest)
    its parameters."""
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.requires_grad]
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return _adam(cls, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "lamb":
        return Lamb(params, lr=lr, betas=betas, eps=max(eps, 1e-6), weight_decay=weight_decay)
    if name == "muon":
        if not isinstance(model, nn.Module):
            raise TypeError("build_optimizer('muon', ...) needs the model, not its parameters")
        return MuonAdam(hidden_matrices(model), params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_at(step: int, *, schedule: str, lr: float, warmup_steps: int, max_steps: int, eta_min: float,
          time_fraction: float = 0.0) -> float:
    """Learning rate for optimiser step `step` (0-based), exactly as kimiyoung's train.py:

    cosine: linear warmup lr·step/warmup, then cosine from lr to eta_min over the *whole* run
    (CosineAnnealingLR(T_max=max_step) evaluated at the global step, warmup included);
    inv_sqrt: step/warmup^1.5 before warmup, 1/sqrt(step) after (times lr);
    constant: warmup then lr.

    time_fraction: the share of a wall-clock budget (max_minutes) already spent. The cosine then follows
    whichever budget is further along, so a run cut by its minutes ends at eta_min on any machine
    instead of being stopped part-way down a schedule sized for another machine's speed (0 = steps only,
    the reference's behaviour).
    """
    if schedule == "inv_sqrt":
        if step == 0 and warmup_steps == 0:
            return lr
        if step > warmup_steps:
            return lr / math.sqrt(step)
        return lr * step / warmup_steps**1.5
    if step < warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * run_progress(step, max_steps, time_fraction))) / 2


def run_progress(step: int, max_steps: int, time_fraction: float = 0.0) -> float:
    """The share of the run done, in [0, 1]: whichever of the steps and the wall-clock budget is further along."""
    return max(min(step, max_steps) / max(max_steps, 1), min(max(time_fraction, 0.0), 1.0))


def dropout_at(step: int, *, start: float, end: float, ramp: float, max_steps: int,
               time_fraction: float = 0.0) -> float:
    """Dropout rate for optimiser step `step` under train.dropout_start: linear from `start` at step 0 to
    `end` (model.dropout) once `ramp` of the run is done, then `end` (Liu et al. 2023's "late dropout",
    made gradual: learn fast while the model underfits, regularise once it starts to overfit). The run's
    progress is the cosine's: whichever of steps and minutes (time_fraction) is further along."""
    return start + (end - start) * min(run_progress(step, max_steps, time_fraction) / ramp, 1.0)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state_split(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """state_dict -> (tensors for safetensors, JSON-able rest)."""
    state = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    plain: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for idx, entry in state["state"].items():
        plain_entry = {}
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state.{idx}.{key}"] = value
            else:
                plain_entry[key] = value
        plain["state"][str(idx)] = plain_entry
    return tensors, plain


def optimizer_state_join(tensors: dict[str, Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in plain.get("state", {}).items()}
    for name, value in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = value
    groups = []
    for group in plain["param_groups"]:  # JSON turned tuples (betas, Muon's ns_coefficients) into lists
        groups.append({k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()})
    return {"state": state, "param_groups": groups}
