"""The engine's process group: NCCL between GPUs, gloo between CPU processes, collectives
with a timeout (a rank that dies fails the others' next collective instead of hanging
them), and the collectives the model and runner call, which are no-ops in one process.

NVLink multicast stays off in every rank: it can take a host's shared GPUs out of service.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# set in each rank by `init`, before NCCL initialises
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TIMEOUT_S = 120.0  # a collective waits this long for the other ranks
# whether this process joined an engine's group (`init`): a process group the program made
# for its own ends (one engine per process under torchrun, say) leaves the engine alone
_joined = False


def init(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = TIMEOUT_S
) -> None:
    """Join the engine's group as `rank` of `size` (a `tcp://` or `file://` rendezvous)."""
    os.environ.update(NO_MULTICAST)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # NCCL's communicator and object collectives use this device
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    global _joined
    _joined = True


def size() -> int:
    """Ranks in the engine's group (1 without one)."""
    return dist.get_world_size() if _joined else 1


def local_ids(ids: torch.Tensor, held: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For a block of ids held here, (first, count) (a rank's experts or vocabulary rows):
    (ids - first where held, 0 elsewhere; whether each is held). No host sync."""
    local = ids - held[0]
    mine = (local >= 0) & (local < held[1])
    return torch.where(mine, local, torch.zeros_like(local)), mine


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x (in place); x itself in one process."""
    if size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, concatenated in rank order along the last dimension."""
    if size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank (in place); x itself in one process."""
    if size() > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_object(obj=None):
    """Rank 0's picklable `obj` on every rank (the others pass None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def close() -> None:
    global _joined
    if _joined:
        dist.destroy_process_group()
        _joined = False
