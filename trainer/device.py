"""The one place that chooses the device and the collective backend: CUDA + NCCL if present, else CPU + gloo."""

from __future__ import annotations

import os
from datetime import timedelta

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


def world_size_from_env() -> int:
    """World size that torchrun announces (1 when launched without it)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(timeout_s: float = 300.0) -> torch.device:
    """Bind this process to its device and, under torchrun, create the default process group."""
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
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()
