"""Language-model loss: summed cross-entropy over valid label tokens.

The trainer divides the sum by the number of valid tokens in the *global* batch (all data-parallel ranks and all
gradient-accumulation microbatches), so every token weighs the same whatever the layout.

Large logits are reduced in chunks of rows (`cross_entropy_sum`): `F.cross_entropy` on `logits.float()` makes an
fp32 copy of all the logits, saves their fp32 log-probabilities for backward and builds an fp32 gradient before
casting it to the logits' dtype, so its peak is about 3 fp32 copies of the logits. In chunks, forward and backward
hold one chunk's fp32 work at a time and backward keeps only the logits themselves (it recomputes each chunk's
log-softmax), about 2 copies in the logits' dtype plus a few chunks. At the one-GPU benchmark's shapes (8192 tokens
x 102400 vocabulary: 3.1 GiB per fp32 copy) a chunk is 128 MiB. Below MIN_CHUNKS chunks the plain formula is used:
the chunks' own copies would cost more than they save.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_BYTES = 128 * 2**20
"""fp32 bytes of one chunk of logits rows."""
MIN_CHUNKS = 4
"""Fewer chunks than this: one plain `F.cross_entropy`."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Sum of token cross-entropies in fp32 (fp64 logits: in fp64); labels equal to IGNORE_INDEX do not count.

    Computed over chunks of at most `chunk_bytes` of fp32 logits when that makes at least MIN_CHUNKS chunks; the
    gradient is exactly that of `F.cross_entropy` on the fp32 logits (row by row the same ops), the loss differs
    only by the order of the sum. Under torch.compile the plain formula is traced (inductor fuses it itself).
    """
    logits_NV, labels_N = logits.flatten(0, -2), labels.flatten()
    rows = chunk_rows(*logits_NV.shape, chunk_bytes)
    if torch.compiler.is_compiling() or rows is None:
        return _chunk_loss(logits_NV, labels_N)
    return _ChunkedCrossEntropySum.apply(logits_NV, labels_N, rows)


def chunk_rows(n_rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int | None:
    """Rows per chunk of `cross_entropy_sum` for [n_rows, vocab] logits; None when it uses the plain formula."""
    rows = max(1, chunk_bytes // (4 * vocab))
    return rows if n_rows >= MIN_CHUNKS * rows else None


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32, or the logits' dtype when wider: an fp64 model (the parity tests') keeps its precision in the loss,
    where an fp32 sum would differ by an fp32 rounding between one batch and the same batch split across ranks."""
    return torch.promote_types(logits.dtype, torch.float32)


def _chunk_loss(logits_CV: torch.Tensor, labels_C: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_CV.to(_loss_dtype(logits_CV)), labels_C, ignore_index=IGNORE_INDEX,
                           reduction="sum")


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Summed fp32 (fp64) cross-entropy of [N, V] logits, `rows` rows at a time; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, labels_N: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.rows = rows
        ctx.save_for_backward(logits_NV, labels_N)
        total = torch.zeros((), dtype=_loss_dtype(logits_NV), device=logits_NV.device)
        for logits_CV, labels_C in zip(logits_NV.split(rows), labels_N.split(rows)):
            total += _chunk_loss(logits_CV, labels_C)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits_NV, labels_N = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        for logits_CV, labels_C, grad_CV in zip(logits_NV.split(ctx.rows), labels_N.split(ctx.rows),
                                                grad_NV.split(ctx.rows)):
            with torch.enable_grad():
                leaf = logits_CV.detach().requires_grad_()
                (chunk_grad,) = torch.autograd.grad(_chunk_loss(leaf, labels_C), leaf, grad_total)
            grad_CV.copy_(chunk_grad)
        return grad_NV, None, None


class ScaledLoss:
    """`loss_fn(output, labels) * scale`, with `scale` set by its owner before each use.

    A pipeline schedule calls its loss per microbatch and runs backward on the result itself, so the loss it gets
    must already carry the step's normalisation (1 / global valid tokens): the training step sets `scale` before
    running the schedule, and the schedule holds this object from its build on.
    """

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels) * self.scale


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that contribute to the loss (int64 scalar tensor on the labels' device)."""
    return (labels != IGNORE_INDEX).sum()
