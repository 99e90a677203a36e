"""DeepSeek-V3: embedding -> blocks (MLA attention + dense FFN or MoE) -> RMSNorm -> output head (+ MTP).

Read top to bottom: RoPE/YaRN tables, MLA attention, the dense FFN, a block, the model. The MoE lives in
`moe.py`, multi-token prediction in `mtp.py`.

Pipeline parallelism deletes whole sub-modules (`tok_embeddings`, some of `layers`, `norm`, `output`) from a copy of
this model per stage, so `forward` and `init_weights` tolerate any of them being absent.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import InitRule, init_parameters_

from .args import ModelArgs
from .moe import MoE, FeedForward
from .mtp import MTPModules
from .norm import RMSNorm


# ----------------------------------------------------------------------------------------------- RoPE and YaRN

def yarn_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [rope_dim/2] in fp32, YaRN-blended when the model extends its context.

    Dimensions rotating fast (more than `beta_fast` turns over the original context) keep their frequency,
    slow ones (fewer than `beta_slow` turns) are interpolated by `rope_factor`; a linear ramp blends in between.
    """
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not args.yarn_enabled:
        return inv_freq.float()

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
    blended = inv_freq / args.rope_factor * (1 - keep) + inv_freq * keep
    return blended.float()


def yarn_softmax_scale(args: ModelArgs) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale^2 under YaRN (attention temperature correction)."""
    scale = args.qk_head_dim ** -0.5
    if args.yarn_enabled:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, rope_dim/2] in fp32."""
    inv_freq = yarn_inv_freq(args).to(device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, S, H, d] by the angles of cos/sin [S, d/2].

    Same layout as DeepSeek's complex-number RoPE (HF `rope_interleave=True`), written with real arithmetic so
    it compiles everywhere.
    """
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


# ----------------------------------------------------------------------------------------------- MLA attention

# The latent norms inside MLA use a fixed eps in DeepSeek's reference and in HF (rms_norm_eps only reaches the block
# and final norms): a checkpoint with rms_norm_eps != 1e-6 must still see 1e-6 here.
MLA_NORM_EPS = 1e-6


class MLA(nn.Module):
    """Multi-head latent attention.

    q: `wq` (q_lora_rank = 0) or `wq_a -> RMSNorm -> wq_b`, split into [nope | rope] per head.
    kv: `wkv_a` -> [kv_lora latent | k_rope]; RMSNorm on the latent, `wkv_b` -> [k_nope | v] per head.
    RoPE only on the rope parts; k_rope is one head shared by all heads.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.softmax_scale = yarn_softmax_scale(args)
        qk_dim = args.n_heads * args.qk_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=MLA_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=MLA_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.context_parallel = None
        """This rank's `ContextParallel` when sequences are split over ranks (set by the parallelize plan): x holds
        this rank's tokens and the keys and values of the whole sequence are gathered."""

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_BSHd = q.view(B, S, self.n_heads, -1)
        q_nope, q_rope = q_BSHd.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)

        latent, k_rope = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)
        cp = self.context_parallel
        if cp is not None:
            # The other ranks' keys and values travel compressed: the latent and the rotated shared rope key
            # (kv_lora_rank + qk_rope_head_dim per token, 576 in the DeepSeek flavors) are 71x fewer bytes than
            # the heads' k and v (128 heads x (192 + 128)); every rank then up-projects the whole sequence.
            kv = cp.gather(torch.cat([latent, k_rope.squeeze(2)], dim=-1), dim=1)
            latent, k_rope = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        kv_BSHd = self.wkv_b(self.kv_norm(latent)).view(B, latent.shape[1], self.n_heads, -1)
        k_nope, v = kv_BSHd.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        q_BHSd = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k_BHSd = torch.cat([k_nope, k_rope.expand(-1, -1, self.n_heads, -1)], dim=-1).transpose(1, 2)
        if cp is None:
            out = attention(q_BHSd, k_BHSd, v.transpose(1, 2), self.softmax_scale, mask)
        else:
            out = cp.attention(q_BHSd, k_BHSd, v.transpose(1, 2), self.softmax_scale, mask)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


def attention(q_BHSd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSv: torch.Tensor, scale: float,
              mask: torch.Tensor | None) -> torch.Tensor:
    """Causal SDPA (or SDPA under a boolean `mask`), choosing the fastest kernel for MLA's unequal head dims.

    CPU's only fused kernel (flash) needs v's head dim to equal q/k's (192 vs 128 here), so SDPA falls back to the
    math kernel, which computes and stores the whole score matrix, masked half included. In bf16/fp16, padding v
    with zeros to q/k's dim and slicing the output is exact and runs the flash kernel, which skips masked blocks
    and is faster at the debug shapes; in fp32 the CPU flash backward is slower than the math one, so fp32 keeps
    the math kernel (both measured in docs/performance.md, "Results"); on CUDA SDPA has kernels for unequal
    dims and gets the tensors as they are.
    """
    if mask is not None:
        return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSv, attn_mask=mask, scale=scale)
    dv, dqk = v_BHSv.shape[-1], q_BHSd.shape[-1]
    if q_BHSd.device.type == "cpu" and q_BHSd.dtype in (torch.bfloat16, torch.float16) and dv < dqk:
        out = F.scaled_dot_product_attention(q_BHSd, k_BHSd, F.pad(v_BHSv, (0, dqk - dv)), is_causal=True,
                                             scale=scale)
        return out[..., :dv]
    return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSv, is_causal=True, scale=scale)


def document_causal_mask(tokens_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Boolean mask [B, 1, S, S]: causal, and no attention across an EOS (each EOS ends its document)."""
    is_eos = (tokens_BS == eos_id).int()
    doc_id = torch.cumsum(is_eos, dim=1) - is_eos  # the EOS itself belongs to the document it closes
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]
    S = tokens_BS.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=tokens_BS.device).tril()
    return (same_doc & causal).unsqueeze(1)


# ----------------------------------------------------------------------------------------------- blocks

class TransformerBlock(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then + ffn(norm(h)); the FFN is dense or MoE by layer id."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args, layer_id)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # out-of-place adds: FSDP2 module outputs may be views, and an in-place add would drop its hooks
        h = h + self.attention(self.attention_norm(h), cos, sin, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3Model(nn.Module):
    """The full model: `model(tokens [B, S]) -> logits [B, S, vocab]`.

    With `num_mtp_layers > 0` and in training mode, the MTP heads' logits are stacked after the main ones:
    `[1 + num_mtp_layers, B, S, vocab]` (see `mtp.py`, and `mtp_loss` in `models/deepseek_v3/__init__.py`
    for the loss).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        problems = args.check()
        if problems:
            raise ValueError("invalid model args: " + "; ".join(problems))
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict keyed by the global layer id, so pipeline stages keep the original parameter names
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = None
        if args.num_mtp_layers > 0:
            self.mtp = MTPModules(args, TransformerBlock)
        cos, sin = rope_tables(args)  # on meta when built under `torch.device("meta")`; init_weights re-creates
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.context_parallel = None
        """This rank's `ContextParallel` when sequences are split over ranks (set by the parallelize plan)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] (int) on the first pipeline stage, hidden states [B, S, D] on later ones.

        With context parallelism (`self.context_parallel`), the first stage gets the whole sequences' tokens and
        keeps this rank's share; hidden states and outputs hold this rank's share [B, S / cp, .] only, at the
        global positions of its tokens (RoPE angles, masks, multi-token prediction's future tokens).
        """
        cp = self.context_parallel
        first_stage = self.tok_embeddings is not None
        S = tokens.shape[1] if first_stage or cp is None else tokens.shape[1] * cp.degree
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        mask = None
        if self.args.document_masking:
            mask = document_causal_mask(tokens, self.args.eos_id)
        whole_tokens = tokens
        if cp is not None:
            cos, sin = cp.shard(cos, 0), cp.shard(sin, 0)
            mask = cp.shard(mask, 2) if mask is not None else None  # this rank's query rows, every key
            tokens = cp.shard(tokens) if first_stage else tokens
        h = self.tok_embeddings(tokens) if first_stage else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is None:
            return h
        logits = self.output(self.norm(h)) if self.output is not None else self.norm(h)
        if self.mtp is not None and self.training:
            return self.mtp(h, whole_tokens, logits, self, cos, sin, mask)
        return logits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int = 0) -> None:
        """Initialise every parameter and re-create the buffers, after materialisation from meta.

        Works on plain and sharded (DTensor) parameters alike and gives the same full weights for the same seed
        whatever the parallel layout (see `models/common/init.py`). Each parameter is seeded by its state_dict key:
        the name that wrappers added by the parallelisms leave unchanged, and the one checkpoints use.
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        cos, sin = rope_tables(self.args, device=device)
        self.rope_cos = cos
        self.rope_sin = sin
        for moe in self.moe_layers():
            moe.reset_buffers(device)
        params = {id(p) for p in self.parameters()}
        init_parameters_(((fqn, tensor, init_rule(self.args, fqn)) for fqn, tensor in
                          self.state_dict(keep_vars=True).items() if id(tensor) in params), seed)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules of this (possibly partial) model, in layer order."""
        found = [layer.moe for layer in self.layers.values() if layer.moe_enabled]
        if self.mtp is not None:
            found += self.mtp.moe_layers()
        return found


# ----------------------------------------------------------------------------------------------- initialisation

def _layer_id(args: ModelArgs, fqn: str) -> int:
    parts = fqn.split(".")
    if parts[0] == "layers":
        return int(parts[1])
    return args.n_layers + int(parts[2])  # mtp.layers.{k}.block...


def init_rule(args: ModelArgs, fqn: str) -> InitRule:
    """How parameter `fqn` is initialised (torchtitan's DeepSeek-V3 recipe).

    Norm weights 1; the embedding N(0, 1); the output head truncated N(0, dim^-0.5) at 3 sigma; projections into
    attention heads and the first FFN/expert projection truncated N(0, 0.02); projections back into the residual
    stream (wo, w2, w3) and the router gate depth-scaled: 0.02 / sqrt(2 (layer_id + 1)), which keeps the residual
    stream's variance bounded as layers add up.
    """
    name = fqn.rsplit(".", 1)[0]
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("norm"):
        return lambda t, g: t.fill_(1.0)
    if fqn == "tok_embeddings.weight":
        return lambda t, g: nn.init.normal_(t, generator=g)
    if fqn == "output.weight":
        std = args.dim ** -0.5
        return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
    depth_scaled = leaf in ("wo", "w2", "w3", "gate") or fqn.endswith(("experts.w2", "experts.w3"))
    std = 0.02 / (2 * (_layer_id(args, fqn) + 1)) ** 0.5 if depth_scaled else 0.02
    return lambda t, g: nn.init.trunc_normal_(t, std=std, generator=g)
