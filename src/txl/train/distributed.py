"""The distributed context of a training run: rank, world size and device under torchrun.

Distribution is DistributedDataParallel under torchrun (gloo on CPU, nccl on GPU), or with
`train.parallelism = "fsdp"` FSDP2 (`shard_model`: parameters, gradients and optimiser state sharded per
block; the whole state gathered for a checkpoint, `full_model_state`): rank r reads rows
[r·B/W, (r+1)·B/W) of the same global batch, so W processes see exactly what one process with the
whole batch sees. Only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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


def launch_local(nproc: int, argv: list[str], *, cpus: int) -> int:
    """`txl train --nproc N`: N ranks of `python -m txl ARGV` on this machine, as `torchrun --standalone`
    starts them (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE), without torchrun's agent, whose report of a
    failed rank is a Python traceback. Rank 0 talks to the terminal; the others' output is kept and shown
    (prefixed) only when a rank failed differently from rank 0, so a mistake stays one line. Each rank gets
    `cpus // nproc` threads unless OMP_NUM_THREADS or --threads says otherwise. Returns the exit code: rank 0's,
    else the first failing rank's."""
    with socket.socket() as probe:  # a free port for the rendezvous (torchrun --standalone does the same)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_RUN_ID="txl-local")
    if "OMP_NUM_THREADS" not in os.environ:
        base["OMP_NUM_THREADS"] = str(max(1, cpus // nproc))  # N ranks x all cores would oversubscribe
    with contextlib.ExitStack() as files:
        logs = [None] + [files.enter_context(tempfile.TemporaryFile()) for _ in range(1, nproc)]
        procs = [subprocess.Popen([sys.executable, "-m", "txl", *argv], stdout=logs[rank], stderr=logs[rank],
                                  env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in range(nproc)]
        return _wait_for_ranks(procs, logs)


def _wait_for_ranks(procs: list, logs: list) -> int:
    # Ctrl-C reaches every rank from the terminal (they stop at a step boundary and save); the launcher waits.
    # A SIGTERM sent to the launcher alone (a job scheduler) is passed on to every rank, as torchrun does.
    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, forward)
    try:
        failed_at = None  # once a rank failed, the others may wait in a collective for it: SIGTERM, then SIGKILL
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            waited = time.monotonic() - failed_at if failed_at is not None else 0.0
            for p in procs:
                if waited > 10 and p.poll() is None:
                    p.kill() if waited > 20 else p.terminate()
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    for rank in range(1, len(procs)):
        if codes[rank] not in (0, codes[0]):
            logs[rank].seek(0)
            for line in logs[rank].read().decode("utf-8", "replace").splitlines()[-20:]:
                print(f"rank {rank}: {line}", file=sys.stderr)
    return codes[0] or next((code for code in codes if code), 0)


# ---------------------------------------------------------------------------------------------
# Sharded training (train.parallelism = "fsdp"): FSDP2, torch.distributed.fsdp.fully_shard


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over `model` in place: each block its own unit (its parameters gathered for its forward and
    backward only), then the root (embeddings, softmax, positions and the rest). Returns the model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


class GradientSync:
    """What the objective asks of DDP (`no_sync()` on the micro-batches before the last), for an FSDP2 model:
    gradients are reduce-scattered on the last micro-batch only."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def _full_options(*, cpu_offload: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def full_model_state(model: torch.nn.Module, *, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The whole state_dict of a sharded model (a collective: every rank calls it): on rank 0 only, on the
    CPU (empty elsewhere), or with `everywhere` on every rank, on the model's device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=not everywhere))


def set_full_model_state(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load a whole state_dict (every rank holds it) into a sharded model: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, weights, options=_full_options(cpu_offload=False))


def _index_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """The optimiser's parameter index (as its state_dict numbers them) -> the parameter's name."""
    names = {id(p): name for name, p in model.named_parameters()}
    described = optimizer.state_dict()["param_groups"]
    return {index: names[id(p)] for group, desc in zip(optimizer.param_groups, described)
            for p, index in zip(group["params"], desc["params"])}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimiser's whole state (a collective), on rank 0 (None elsewhere), in the form of
    `optimizer.state_dict()` of one process (parameters by index), so the files stay those of any run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if not full:  # the other ranks
        return None
    by_name = full.get("state", {})
    state = {index: by_name[name] for index, name in _index_names(model, optimizer).items() if name in by_name}
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def set_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, joined: dict) -> None:
    """Load an optimiser state in `optimizer.state_dict()`'s form (whole tensors, every rank holds it) into
    the optimiser of a sharded model."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _index_names(model, optimizer)
    state = {names[index]: value for index, value in joined["state"].items()}
    groups = [{**group, "params": [names[index] for index in group["params"]]} for group in joined["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                             options=_full_options(cpu_offload=False))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def shared_precision(chosen: str, dist) -> str:
    """What `auto` became on this rank -> what every rank uses: on a CPU it comes from a timed probe
    (`txl.eval.precision.fast_bf16`) that may differ between processes, and on CUDA from each GPU's compute
    capability (bf16 from 8.0, else fp16): a half precision only if every rank chose it, else fp32."""
    if dist.world == 1:
        return chosen
    votes = dist.all_sum([float(chosen == "bf16"), float(chosen == "fp16")])
    for half, count in zip(("bf16", "fp16"), votes):
        if count == dist.world:
            return half
    return "fp32"
