"""GTrXL's gated residual (Parisotto et al. 2019, "Stabilizing Transformers for Reinforcement Learning",
arXiv 1910.06764, §3 and eq. (7)-(10)): the GRU-type gate that replaces x + y in an identity-map
(pre-LN) block, applied to the sub-layer's output after a ReLU:

    r = σ(W_r y + U_r x)
    z = σ(W_z y + U_z x − b_g)
    ĥ = tanh(W_g y + U_g (r ⊙ x))
    g(x, y) = (1 − z) ⊙ x + z ⊙ ĥ

x is the residual stream, y the sub-layer output. b_g > 0 makes z small at initialisation, so each
block starts close to the identity map (the paper's key to training stability; it reports b_g = 2, and
so z ≈ σ(−2) ≈ 0.12 while the weights are small). b_g is a learned vector here, initialised to b_g.
The six matrices have no bias besides b_g, as the paper writes them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from txl.nn.backend import REFERENCE, Backend

GATE_BIAS = 2.0  # b_g (Parisotto et al. 2019, §4: "we found b_g = 2 to work well")


class GRUGate(nn.Module):
    """`gate(x, y)` -> (b, t, d): x the residual stream, y the (ReLU'd) sub-layer output, both (b, t, d)."""

    def __init__(self, d_model: int, *, backend: Backend = REFERENCE, bias: float = GATE_BIAS):
        super().__init__()
        self.initial_bias = bias
        self.w = backend.Linear(d_model, 3 * d_model, bias=False)  # W_r, W_z, W_g on y
        self.u = backend.Linear(d_model, 2 * d_model, bias=False)  # U_r, U_z on x
        self.u_g = backend.Linear(d_model, d_model, bias=False)  # U_g on r ⊙ x
        self.gate_bias = nn.Parameter(torch.full((d_model,), bias))  # b_g

    def reset_bias(self) -> None:
        nn.init.constant_(self.gate_bias, self.initial_bias)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        w_r, w_z, w_g = self.w(y).chunk(3, dim=-1)
        u_r, u_z = self.u(x).chunk(2, dim=-1)
        r = torch.sigmoid(w_r + u_r)
        z = torch.sigmoid(w_z + u_z - self.gate_bias.to(x.dtype))
        candidate = torch.tanh(w_g + self.u_g(r * x))
        return torch.lerp(x, candidate, z)  # (1 − z) ⊙ x + z ⊙ ĥ

    def extra_repr(self) -> str:
        return f"b_g={self.initial_bias}"


__all__ = ["GATE_BIAS", "GRUGate"]
