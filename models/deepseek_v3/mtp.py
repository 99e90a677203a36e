"""Multi-token prediction (DeepSeek-V3 section 2.2).

MTP module k (k = 1..D) predicts token t_{i+k+1} at position i. It combines the previous depth's hidden state h_i
with the embedding of t_{i+k}: h' = eh_proj([enorm(emb(t_{i+k})); hnorm(h_i)]), runs one transformer block, and
reads logits through its own RMSNorm and the model's shared output head. The embedding and head are shared with
the main model. Module names follow the hub checkpoint's layer `n_layers + k - 1` (enorm, hnorm, eh_proj, block,
shared_head.norm).
"""

from __future__ import annotations

import torch
from torch import nn

from .args import ModelArgs
from .norm import RMSNorm


class MTPModule(nn.Module):
    """One MTP depth."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        from .model import TransformerBlock

        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)


class MTPModules(nn.Module):
    """The D sequential MTP depths; returns main and MTP logits stacked: [1 + D, B, S, vocab]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layers = nn.ModuleList(MTPModule(args.n_layers + k, args) for k in range(args.num_mtp_layers))

    def forward(self, h, tokens, logits, model, cos, sin, mask):
        outs = [logits]
        for k, mod in enumerate(self.layers, start=1):
            # position i needs t_{i+k}: the last k positions wrap around, and their targets are ignored by the loss
            future_tokens = torch.roll(tokens, shifts=-k, dims=1)
            emb = model.tok_embeddings(future_tokens)
            h = mod.eh_proj(torch.cat([mod.enorm(emb), mod.hnorm(h)], dim=-1))
            h = mod.block(h, cos, sin, mask)
            outs.append(model.output(mod.norm(h)))
        return torch.stack(outs)

    def moe_layers(self) -> list:
        return [mod.block.moe for mod in self.layers if mod.block.moe_enabled]


def mtp_loss(output: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """Summed main loss + weight / D * sum of the D MTP losses, for output [1 + D, B, S, V] in training.

    Depth k predicts labels shifted left by k (token t_{i+k+1} at position i); the last k positions of each
    sequence have no target and are ignored. In eval mode the model returns plain logits [B, S, V].
    """
    from trainer.loss import IGNORE_INDEX, cross_entropy_sum

    if output.dim() == 3:
        return cross_entropy_sum(output, labels)
    depth = output.shape[0] - 1
    total = cross_entropy_sum(output[0], labels)
    mtp_total = 0.0
    for k in range(1, depth + 1):
        shifted = torch.roll(labels, shifts=-k, dims=1)
        shifted[:, -k:] = IGNORE_INDEX
        mtp_total = mtp_total + cross_entropy_sum(output[k], shifted)
    return total + (weight / depth) * mtp_total
