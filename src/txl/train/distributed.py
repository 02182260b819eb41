"""The distributed context of a training run: rank, world size and device under torchrun.

Distribution is DistributedDataParallel under torchrun (gloo on CPU, nccl on GPU): rank r reads rows
[r·B/W, (r+1)·B/W) of the same global batch, so W processes see exactly what one process with the
whole batch sees. Only rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from txl.errors import UsageError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of `tensor`, in rank order (just [tensor] in one process)."""
        if self.world == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous())
        return parts


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name}={value!r} must be a non-negative integer (torchrun sets it); "
                         f"unset it to train in one process")
    return int(value)


def init_distributed(device: str) -> Dist:
    world = max(env_int("WORLD_SIZE", 1), 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", 0)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank=rank, world=world, local_rank=local_rank, device=dev)
