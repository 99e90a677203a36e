"""The one place that chooses the device and the collective backend: CUDA + NCCL if present, else CPU + gloo."""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist


def device_type() -> str:
    """"cuda" when a CUDA device is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    """Collective backend matching `device_type()`: gloo on CPU; on CUDA NCCL for CUDA tensors plus gloo for CPU
    tensors, which `torch.distributed.checkpoint.async_save` needs (with NCCL alone it raises an AssertionError)."""
    return "cuda:nccl,cpu:gloo" if device_type() == "cuda" else "gloo"


def local_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK on GPU machines, cpu otherwise."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def memory_per_rank_bytes(world_size: int) -> int:
    """Memory one rank may use: the GPU's total memory; on CPU the host's physical memory shared by the ranks of
    this node (`LOCAL_WORLD_SIZE`, else `world_size`)."""
    if device_type() == "cuda":
        return torch.cuda.get_device_properties(local_device()).total_memory
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def world_size_from_env() -> int:
    """World size that torchrun announces (1 when launched without it)."""
    return int(os.environ.get("WORLD_SIZE", 1))


_started_group = False  # this process created a process group (end_process then skips the interpreter teardown)
_store: dist.Store | None = None  # the store every rank joined (heartbeats: trainer/watchdog.py)
_rank: int | None = None  # this process's rank in the group it created, kept after the group is destroyed


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Bind this process to its device and, under torchrun, create the default process group."""
    global _started_group, _store, _rank
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps its agent's store across elastic restarts: without a per-attempt prefix, restarted ranks
        # read the dead ranks' addresses and fail to connect (seen with gloo in torch 2.13)
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend(), store=store, rank=rank_, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        _started_group, _rank = True, rank_
        _store = dist.PrefixStore("trainer", store)
    return device


def store() -> dist.Store | None:
    """The store of the process group this process created (None without one)."""
    return _store


def rank() -> int:
    """This process's rank: the process group's, also after the group is destroyed (a rank's last line after a
    peer died names the rank itself, not 0); 0 in a process without a group."""
    if dist.is_initialized():
        return dist.get_rank()
    return _rank if _rank is not None else 0


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """Exit with `code`. In a process that created a process group, flush the logs and the standard streams and
    end with `os._exit`, without the interpreter's teardown; call it once everything is closed.

    Why: once a functional collective ran on a group (DTensor redistribution: gradient-norm clipping under FSDP2,
    EP), torch keeps that group alive after `destroy_process_group` (torch 2.13, gloo: its 12 worker threads of 4
    groups still run; docs/torch_versions.md). The interpreter's teardown then races those threads, and now and
    then a finished run died with SIGABRT ("terminate called without an active exception"), which torchrun
    reports as a failed run.
    """
    if not _started_group:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on `device`. On CUDA it goes through pinned memory without blocking: a copy from
    pageable memory, or a blocking one, makes the host wait until the device has caught up (a synchronisation per
    microbatch). torch's pinned-memory cache keeps the pinned copy until the transfer has run."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
