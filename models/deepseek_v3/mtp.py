"""Multi-token prediction (DeepSeek-V3 section 2.2).

MTP module k (k = 1..D) predicts token t_{i+k+1} at position i. It combines the previous depth's hidden state h_i
with the embedding of t_{i+k}: h' = eh_proj([enorm(emb(t_{i+k})); hnorm(h_i)]), runs one transformer block, and
reads logits through its own RMSNorm and the model's shared output head. The embedding and head are shared with
the main model. Module names follow the hub checkpoint's layer `n_layers + k - 1` (enorm, hnorm, eh_proj, block,
shared_head.norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .args import ModelArgs
from .norm import RMSNorm


class MTPModule(nn.Module):
    """One MTP depth; `make_block(layer_id, args)` builds its transformer block (see `MTPModules`)."""

    def __init__(self, layer_id: int, args: ModelArgs, make_block: Callable[[int, ModelArgs], nn.Module]):
        super().__init__()
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = make_block(layer_id, args)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)


class MTPModules(nn.Module):
    """The D sequential MTP depths; returns main and MTP logits stacked: [1 + D, B, S, vocab].

    `make_block(layer_id, args)` builds each depth's transformer block (the model passes its block class: this
    module then needs nothing from `model.py`, which imports it).
    """

    def __init__(self, args: ModelArgs, make_block: Callable[[int, ModelArgs], nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(MTPModule(args.n_layers + k, args, make_block)
                                    for k in range(args.num_mtp_layers))

    def forward(self, h, tokens, logits, model, cos, sin, mask):
        """`tokens`: the whole sequences' tokens, also under context parallelism (`model.context_parallel`), where
        h, logits, cos, sin and mask hold this rank's share: the shift crosses the ranks' chunk borders."""
        outs = [logits]
        cp = model.context_parallel
        for k, mod in enumerate(self.layers, start=1):
            # position i needs t_{i+k}: the last k positions wrap around, and their targets are ignored by the loss
            future_tokens = torch.roll(tokens, shifts=-k, dims=1)
            if cp is not None:
                future_tokens = cp.shard(future_tokens)
            emb = model.tok_embeddings(future_tokens)
            h = mod.eh_proj(torch.cat([mod.enorm(emb), mod.hnorm(h)], dim=-1))
            h = mod.block(h, cos, sin, mask)
            outs.append(model.output(mod.norm(h)))
        return torch.stack(outs)

    def moe_layers(self) -> list:
        return [mod.block.moe for mod in self.layers if mod.block.moe_enabled]

