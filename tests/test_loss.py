"""core/loss.py: the chunked cross-entropy against `F.cross_entropy` on fp32 logits (values, gradients, memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.loss import IGNORE_INDEX, cross_entropy_sum
from trainer.memory.monitor import MemoryMonitor


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _batch(shape, vocab, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels.view(-1)[:7] = IGNORE_INDEX
    labels.view(-1)[100:150] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, chunk_bytes", [((2, 300), 1 << 14), ((2, 300), 1 << 30), ((3, 2, 50), 40_000)],
                         ids=["150_chunks", "plain", "mtp_shape_6_chunks"])
def test_chunked_loss_and_gradient_equal_the_plain_formula(dtype, shape, chunk_bytes):
    logits, labels = _batch(shape, 1000, dtype)
    got, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy_sum(got, labels, chunk_bytes=chunk_bytes)
    ref = reference(want, labels)
    (loss / 543).backward()
    (ref / 543).backward()
    assert loss.dtype == torch.float32
    # the same per-row ops: gradients bit for bit; the loss differs by the order of its sum only
    assert torch.equal(got.grad, want.grad)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert got.grad.view(-1, 1000)[:7].abs().sum() == 0  # ignored labels


def test_chunking_starts_at_four_chunks():
    logits, labels = _batch((2, 300), 1000, torch.bfloat16)
    x = logits.requires_grad_()
    row_bytes = 4 * 1000
    assert "Chunked" in type(cross_entropy_sum(x, labels, chunk_bytes=150 * row_bytes).grad_fn).__name__
    assert "Chunked" not in type(cross_entropy_sum(x, labels, chunk_bytes=151 * row_bytes).grad_fn).__name__
    with torch.no_grad():  # validation: no graph, same value
        assert cross_entropy_sum(logits, labels, chunk_bytes=10 * row_bytes).item() == pytest.approx(
            reference(logits, labels).item(), rel=1e-6)


def _loss_peak_bytes(loss_fn, dtype) -> int:
    """Peak tensor bytes (exact tracker) of output head + loss forward and backward, above the inputs."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1024, 64, generator=gen).to(dtype).requires_grad_()
    head = (torch.randn(8192, 64, generator=gen) * 0.05).to(dtype)
    labels = torch.randint(0, 8192, (1024,), generator=gen)
    monitor = MemoryMonitor(torch.device("cpu"), "exact")
    monitor.track(hidden, head, labels)
    with monitor:
        base = monitor.step_end().allocated_bytes
        logits = hidden @ head.T
        loss = loss_fn(logits, labels)
        del logits
        (loss / 1024).backward()
        return monitor.step_end().peak_bytes - base


def test_chunked_loss_holds_less_memory_for_bf16_logits():
    """bf16 logits [1024, 8192] (16 MiB) in 2 MiB fp32 chunks: the plain formula peaks at about 3 fp32 copies of
    the logits, the chunked one at about 2 bf16 copies plus a few chunks."""
    plain = _loss_peak_bytes(reference, torch.bfloat16)
    chunked = _loss_peak_bytes(lambda x, y: cross_entropy_sum(x, y, chunk_bytes=2 * 2**20), torch.bfloat16)
    logits_bytes = 1024 * 8192 * 2
    assert plain >= 5 * logits_bytes
    assert chunked <= 2.8 * logits_bytes
