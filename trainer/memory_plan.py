"""Memory plan: predict the per-rank peak of a training step before allocating anything.

`python -m trainer.memory_plan --config X.toml --ngpu N [--json] [--device cpu|cuda] [overrides...]`
(`--job.config_file X.toml` works too). For one rank per pipeline stage, `parallelisms.dry_run` joins a fake process
group, builds the meshes, the pipeline split, EP and FSDP on a meta-device model and counts the rank's local
parameters; this module adds an analytic model of the step on top of those counts:

* state: parameters (fp32 master, local shards), gradients (same), AdamW state (2x parameters);
* activations held after forward under the activation-checkpointing policy, itemised per block from the model
  args (what autograd saves with no AC; block inputs for full AC; the outputs of `save_ops` for per-op selective);
* transients: the loss (logits and their fp32 softmax, in chunks for large logits), one block's backward
  (recompute under AC, gradient buffers, the attention score gradients), FSDP all-gathers and unsharded gradients,
  EP buffers, the optimizer's foreach temporaries (one tile, or the whole part).

Predicted peak (steady state, from step 2 on, when the AdamW state exists):

    params + optimizer_state + buffers + max(forward/backward peak, gradients + optimizer transient)

where the forward/backward peak walks the backward block by block: the activations of the blocks not yet
reached, plus the current block's recompute and working set, plus the gradients produced so far (see
docs/memory.md, "Memory plan"). Sizes assume balanced routing (every expert rank receives T*top_k rows).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

from parallelisms.dry_run import report
from trainer.config import run_with_config_errors
from trainer.job_config import load_config, validate_job
from trainer.loss import chunk_rows

__all__ = ["plan", "block_items", "main"]

_I64, _F32 = 8, 4


@dataclasses.dataclass(frozen=True)
class Item:
    """One tensor a block creates in forward: its bytes, whether autograd keeps it without AC, and its op."""

    name: str
    nbytes: int
    saved: bool  # kept for backward when the block is not checkpointed
    op: str  # producing op as named in `save_ops` ("input", "other": ops no policy saves)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate needs about one forward of one microbatch."""

    B: int
    S: int
    act: int  # bytes per activation element (2 for bf16, 4 for fp32)
    sdpa: str  # "math" (CPU fp32: [B, H, S, S] scores and probabilities), "flash" (no score matrix) or
    # "flash_padded_v" (CPU bf16: flash with v zero-padded to the q/k head dim, models/deepseek_v3/model.attention)
    ep: int

    @property
    def T(self) -> int:
        return self.B * self.S


def _norm(prefix: str, T: int, width: int, a: int) -> list[Item]:
    # nn.RMSNorm decomposes on CPU: x (kept as the input), rsqrt, x * rsqrt, and the weighted output
    return [Item(f"{prefix}.rsqrt", T * _F32, True, "other"),
            Item(f"{prefix}.normed", T * width * a, True, "mul"),
            Item(f"{prefix}.out", T * width * a, True, "mul")]


def _swiglu(prefix: str, rows: int, dim: int, hidden: int, a: int, mm: str) -> list[Item]:
    return [Item(f"{prefix}.w1", rows * hidden * a, True, mm),
            Item(f"{prefix}.w3", rows * hidden * a, True, mm),
            Item(f"{prefix}.silu", rows * hidden * a, True, "silu"),
            Item(f"{prefix}.prod", rows * hidden * a, True, "mul"),
            Item(f"{prefix}.w2", rows * dim * a, False, mm)]


def block_items(args, moe: bool, sh: Shape, aux_loss: bool = False) -> list[Item]:
    """Every tensor of interest one transformer block creates in forward, for one microbatch."""
    T, a, D, H = sh.T, sh.act, args.dim, args.n_heads
    items = [Item("input", T * D * a, True, "input")]
    items += _norm("attention_norm", T, D, a)
    if args.q_lora_rank:
        items.append(Item("wq_a", T * args.q_lora_rank * a, True, "mm"))
        items += _norm("q_norm", T, args.q_lora_rank, a)
        items.append(Item("wq_b", T * H * args.qk_head_dim * a, False, "mm"))
    else:
        items.append(Item("wq", T * H * args.qk_head_dim * a, False, "mm"))
    items.append(Item("wkv_a", T * (args.kv_lora_rank + args.qk_rope_head_dim) * a, True, "mm"))
    items += _norm("kv_norm", T, args.kv_lora_rank, a)
    items.append(Item("wkv_b", T * H * (args.qk_nope_head_dim + args.v_head_dim) * a, False, "mm"))
    bhs = sh.B * H * sh.S
    if sh.sdpa == "math":
        # math path: q and k scaled copies and v made contiguous for the bmms, fp32 scores and probabilities
        items += [Item("sdpa.q", bhs * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.k", bhs * args.qk_head_dim * _F32, True, "mul"),
                  Item("sdpa.scores", bhs * sh.S * _F32, False, "mm"),
                  Item("sdpa.probs", bhs * sh.S * _F32, True, "softmax"),
                  Item("sdpa.v", bhs * args.v_head_dim * _F32, True, "other"),
                  Item("sdpa.out", bhs * args.v_head_dim * _F32, False, "mm")]
    else:
        # fused kernels keep q, k (the concatenated copies), the output and the fp32 log-sum-exp; with padded v
        # also the padded copy, and the output has q/k's head dim
        dv = args.qk_head_dim if sh.sdpa == "flash_padded_v" else args.v_head_dim
        if sh.sdpa == "flash_padded_v":
            items.append(Item("sdpa.v_padded", bhs * dv * a, True, "other"))
        items += [Item("sdpa.q", bhs * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.k", bhs * args.qk_head_dim * a, True, "other"),
                  Item("sdpa.out", bhs * dv * a, True, "attention"),
                  Item("sdpa.lse", bhs * _F32, True, "attention")]
    items.append(Item("wo.input", T * H * args.v_head_dim * a, True, "other"))
    items.append(Item("wo", T * D * a, False, "mm"))
    items += _norm("ffn_norm", T, D, a)
    if not moe:
        return items + _swiglu("feed_forward", T, D, args.inter_dim, a, "mm")
    E, K = args.n_routed_experts, args.n_activated_experts
    N = T * K  # rows into the experts of this rank: T * top_k on average, whatever the EP degree
    I = args.moe_inter_dim
    if a != _F32:
        items.append(Item("router.x_fp32", T * D * _F32, True, "other"))
    items += [Item("router.gate", T * E * _F32, False, "mm"),
              Item("router.scores", T * E * _F32, True, "softmax"),
              Item("router.topk", T * K * (_I64 + _F32), True, "topk"),
              Item("dispatch.order", 2 * N * _I64, True, "other"),
              Item("experts.x", N * D * a, True, "other"),
              Item("experts.w1", N * I * a, True, "grouped_mm"),
              Item("experts.w3", N * I * a, True, "grouped_mm"),
              Item("experts.silu", N * I * a, True, "silu"),
              Item("experts.prod", N * I * a, True, "mul"),
              Item("experts.w2", N * D * a, False, "grouped_mm"),
              Item("experts.y", N * D * a, True, "other"),
              Item("combine.weights_index", N * (_F32 + _I64), True, "other")]
    if sh.ep > 1:
        # all-to-all outputs (tokens there and back) and the regrouping indices
        items += [Item("ep.recv", N * D * a, False, "all_to_all"),
                  Item("ep.back", N * D * a, False, "all_to_all"),
                  Item("ep.regroup", 2 * N * _I64, True, "other")]
    if args.n_shared_experts:
        items += _swiglu("shared_experts", T, D, I * args.n_shared_experts, a, "mm")
    if aux_loss:
        items.append(Item("aux_loss", 2 * T * E * _F32, True, "other"))
    return items


def _held(items: list[Item], mode: str, save_ops: set[str]) -> tuple[int, int]:
    """(bytes kept after forward, bytes the backward recomputes) of one block under `mode`."""
    none_kept = sum(i.nbytes for i in items if i.saved)
    if mode == "none":
        return none_kept, 0
    if mode == "full":
        block_input = items[0].nbytes
        return block_input, none_kept - block_input
    kept = sum(i.nbytes for i in items if i.op == "input" or i.op in save_ops)
    recomputed = sum(i.nbytes for i in items if i.saved and i.op != "input" and i.op not in save_ops)
    return kept, recomputed


def _block_modes(cfg, layer_ids: list[int]) -> dict[int, str]:
    """AC mode per block: none, full or op (per-op selective)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.granularity == "layer":
        return {i: "full" if (i + 1) % ac.layer_freq == 0 else "none" for i in layer_ids}
    if ac.mode == "selective":
        return {i: "op" for i in layer_ids}
    return {i: ac.mode for i in layer_ids}


def _unit_numel(args) -> dict[str, int]:
    """Parameter count of the pieces FSDP gathers as units (full, before any sharding)."""
    D, H = args.dim, args.n_heads
    q = D * H * args.qk_head_dim if not args.q_lora_rank else (
        D * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * H * args.qk_head_dim)
    attn = q + D * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank + \
        args.kv_lora_rank * H * (args.qk_nope_head_dim + args.v_head_dim) + H * args.v_head_dim * D + 2 * D
    shared = 3 * D * args.moe_inter_dim * args.n_shared_experts
    return {"embedding": args.vocab_size * D, "head": args.vocab_size * D + D,
            "dense_block": attn + 3 * D * args.inter_dim,
            "moe_block": attn + shared + args.n_routed_experts * D,
            "experts": 3 * args.n_routed_experts * D * args.moe_inter_dim}


def _stage_layout(stages: list[str]) -> tuple[list[int], bool, bool]:
    """Layer ids, has-embedding, has-head of a rank from dry_run's compact stage names."""
    layers, first, last = [], False, False
    for stage in stages:
        for token in stage.split():
            if token == "all":
                return [], True, True
            m = re.fullmatch(r"layers\.(\d+)(?:-(\d+))?", token)
            if m:
                layers += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
            first |= token == "tok_embeddings"
            last |= token == "output"
    return layers, first, last


def _optimizer_transient(cfg, param_bytes: int, largest_local_param: int) -> int:
    """Foreach AdamW allocates one parameter-sized temporary per group; fused and for-loop almost nothing."""
    opt = cfg.optimizer
    if opt.implementation == "fused":
        return 0
    if opt.implementation == "for-loop":
        return largest_local_param
    if opt.max_group_bytes > 0:
        return min(param_bytes, max(opt.max_group_bytes, largest_local_param))
    return param_bytes


def plan_rank(cfg, world_size: int, dry: dict, device: str = "cpu") -> dict:
    """The memory plan of one rank, from its dry-run row (`parallelisms.dry_run.inspect_rank`)."""
    from trainer.registry import get_model_spec

    dims = validate_job(cfg, world_size)
    args = get_model_spec(cfg.model.name).build_args(cfg)
    bf16 = cfg.training.dtype == "bfloat16"
    a = 2 if bf16 else 4
    layer_ids, first, last = _stage_layout(dry["stages"])
    if not layer_ids:
        layer_ids = list(range(args.n_layers))
    par = cfg.parallelism
    B = par.pipeline_parallel_microbatch_size if dims.pp_enabled else cfg.training.local_batch_size
    sdpa = "flash" if device == "cuda" else ("flash_padded_v" if bf16 else "math")
    sh = Shape(B, cfg.training.seq_len, a, sdpa, dims.ep)
    T, D, V = sh.T, args.dim, args.vocab_size
    ac = cfg.activation_checkpoint
    save_ops = set(ac.save_ops) | {"d2h_copy"}
    modes = _block_modes(cfg, layer_ids)
    notes = []
    if ac.recompute_modules:
        notes.append("recompute_modules is not modelled: estimated as mode none (an upper bound)")
        modes = {i: "none" for i in layer_ids}

    params = dry["param_bytes"]
    shard = dims.dp_shard if dims.dp_enabled else 1
    units = _unit_numel(args)
    pbytes = 2 if bf16 and dims.dp_enabled else 4  # FSDP gathers in param_dtype
    # FSDP units this rank gathers: dense parts over the dense mesh, experts over what is left after EP
    unit_bytes = {"embedding": units["embedding"] * pbytes, "head": units["head"] * pbytes,
                  "dense_block": units["dense_block"] * pbytes, "moe_block": units["moe_block"] * pbytes,
                  "experts": units["experts"] // dims.ep * pbytes}
    largest_local_param = max(V * D, args.n_routed_experts * D * args.moe_inter_dim // dims.ep) * 4 // shard

    # per-block activations and backward working sets
    blocks = []
    for i in layer_ids:
        moe = i >= args.n_dense_layers
        items = block_items(args, moe, sh, cfg.moe.aux_loss_coeff > 0)
        kept, recomputed = _held(items, modes[i], save_ops)
        ffn = sum(it.nbytes for it in items if it.saved and it.name.startswith(
            ("router", "dispatch", "experts", "combine", "ep.", "shared", "feed_forward", "aux")))
        # the attention backward holds the score gradient and the softmax gradient at once (math path)
        attn_ws = 2 * sh.B * args.n_heads * sh.S * sh.S * _F32 if sh.sdpa == "math" else \
            3 * T * args.n_heads * args.qk_head_dim * a
        hidden = args.moe_inter_dim * max(args.n_shared_experts, 1) if moe else args.inter_dim
        ffn_ws = 3 * max(T * args.n_activated_experts * args.moe_inter_dim if moe else 0, T * hidden) * a
        if moe and dims.ep > 1:
            ffn_ws += 2 * T * args.n_activated_experts * D * a  # all-to-all buffers of the gradients
        unit = unit_bytes["moe_block" if moe else "dense_block"] + (unit_bytes["experts"] if moe else 0)
        local_numel = (units["moe_block"] + units["experts"] // dims.ep) // shard if moe else \
            units["dense_block"] // shard
        blocks.append(dict(layer=i, mode=modes[i], kept=kept, recomputed=recomputed, ffn_saved=ffn,
                           attn_ws=attn_ws, ffn_ws=ffn_ws, unit=unit, grad=local_numel * 4))

    n_micro = cfg.training.local_batch_size // B
    in_flight = 1
    if dims.pp_enabled:
        pp_rank = dry["coords"].get("pp", 0)
        in_flight = n_micro if par.pipeline_parallel_schedule == "GPipe" else min(n_micro, dims.pp - pp_rank)
        notes.append(f"pipeline: {in_flight} microbatch(es) in flight assumed (1F1B warm-up depth)")

    head_kept = (3 * T * D * a + T * V * _F32) if last else 0  # final norm, output input, log_softmax out
    emb_kept = T * _I64 if first else 0
    activations = in_flight * (sum(b["kept"] for b in blocks) + head_kept + emb_kept)
    if bf16 and not dims.dp_enabled:
        # autocast caches a bf16 copy of every weight for the whole forward; the mms save them for backward
        activations += params // 2
        notes.append("bf16 without FSDP: autocast weight copies counted as activations")

    # FSDP: during a unit's backward its parameters are gathered again, its unsharded gradients and their
    # reduce-scatter copy exist, and the next unit is prefetched: about 4 units; forward holds 2 (prefetch)
    fsdp = dims.dp_enabled and shard > 1
    largest_unit = max([b["unit"] for b in blocks] + ([unit_bytes["head"]] if last else []) +
                       ([unit_bytes["embedding"]] if first else []))
    fsdp_factor = 4 if fsdp else 0
    last_block_unit = blocks[-1]["unit"] if blocks else 0
    fsdp_loss = (3 * unit_bytes["head"] + last_block_unit) if fsdp and last else 0

    # the loss: logits stay referenced while their fp32 softmax gradient and the nll gradient are built; chunked
    # (large logits, trainer/loss.py), the logits and their gradient plus one chunk's fp32 work and gradient
    head_grad = (units["head"] // shard) * 4 if last else 0
    rows = chunk_rows(T, V)
    if rows is None:
        loss_transient = T * V * a + 2 * T * V * _F32 + T * D * a
    else:
        loss_transient = 2 * T * V * a + 3 * rows * V * _F32 + rows * V * a + T * D * a
    loss_transient = loss_transient if last else 0
    # every in-flight microbatch's activations are alive when the last one's backward starts
    phases = {"loss_backward": activations + loss_transient + head_grad + fsdp_loss if last else 0,
              "forward_end": activations + (2 * largest_unit if fsdp else 0)}
    grads_done = head_grad
    below = activations - head_kept  # the head's saved tensors are freed by the loss backward
    for b in reversed(blocks):
        below -= b["kept"]
        # + incoming and outgoing hidden-state gradients
        common = below + grads_done + b["grad"] + fsdp_factor * b["unit"] + 2 * T * D * a
        block = b["kept"] + b["recomputed"]
        ffn_phase = common + block + b["ffn_ws"]
        attn_phase = common + block - b["ffn_saved"] + b["attn_ws"]
        phases[f"backward_layer_{b['layer']}"] = max(ffn_phase, attn_phase)
        grads_done += b["grad"]
    grads = dry["grad_bytes"]
    opt_state = dry["optimizer_bytes"]
    opt_transient = _optimizer_transient(cfg, params, largest_local_param)
    fwd_bwd_peak = max(phases.values())
    optimizer_phase = grads + opt_transient
    buffers = 2 * args.max_seq_len * args.qk_rope_head_dim // 2 * _F32 + \
        3 * args.n_routed_experts * _F32 * sum(1 for i in layer_ids if i >= args.n_dense_layers)
    peak = params + opt_state + buffers + max(fwd_bwd_peak, optimizer_phase)
    worst = max(phases, key=phases.get)
    transients = {"optimizer_step": opt_transient, "fsdp_all_gather_largest_unit": largest_unit if fsdp else 0,
                  "fsdp_backward": fsdp_factor * max([b["unit"] for b in blocks] + [0]), "loss_logits_softmax": loss_transient,
                  "ep_buffers": 2 * T * args.n_activated_experts * D * a if dims.ep > 1 else 0,
                  "backward_working_set": phases[worst] - activations}
    return {
        "rank": dry["rank"], "coords": dry["coords"], "stages": dry["stages"], "layers": layer_ids,
        "ac_modes": sorted(set(modes.values())), "microbatch": [B, sh.S], "microbatches_in_flight": in_flight,
        "params": dry["params"], "parameter_bytes": params, "gradient_bytes": grads,
        "optimizer_state_bytes": opt_state, "buffer_bytes": buffers, "activation_bytes": activations,
        "transients": transients,
        "largest_transient": max(transients, key=transients.get),
        "forward_backward_peak_bytes": fwd_bwd_peak, "forward_backward_peak_at": worst,
        "optimizer_phase_bytes": optimizer_phase,
        "peak_phase": "optimizer_step" if optimizer_phase >= fwd_bwd_peak else worst,
        "predicted_peak_bytes": peak, "notes": notes,
    }


def plan(cfg, world_size: int, device: str = "cpu") -> dict:
    """The memory plan of every representative rank (the first rank of each pipeline stage)."""
    ranks = [plan_rank(cfg, world_size, row, device) for row in report(cfg, world_size)]
    return {"model": f"{cfg.model.name}/{cfg.model.flavor}", "world_size": world_size, "device": device,
            "activation_checkpoint": cfg.activation_checkpoint.mode, "ranks": ranks}


def _print(result: dict) -> None:
    gib = 2 ** 30
    print(f"memory plan: {result['model']} on {result['world_size']} ranks ({result['device']}, "
          f"AC {result['activation_checkpoint']})")
    for r in result["ranks"]:
        print(f"rank {r['rank']:>5} {r['coords']}  stages: {'; '.join(r['stages'])}")
        print(f"    params {r['parameter_bytes'] / gib:.3f} GiB  grads {r['gradient_bytes'] / gib:.3f} GiB  "
              f"AdamW {r['optimizer_state_bytes'] / gib:.3f} GiB  activations {r['activation_bytes'] / gib:.3f} GiB")
        big = ", ".join(f"{k} {v / gib:.3f}" for k, v in r["transients"].items() if v)
        print(f"    transients (GiB): {big}")
        print(f"    predicted peak {r['predicted_peak_bytes'] / gib:.3f} GiB, at {r['peak_phase']}")
        for note in r["notes"]:
            print(f"    note: {note}")


def main(argv: list[str]) -> None:
    """CLI: `--config X.toml` (or `--job.config_file`), `--ngpu N`, `--json`, `--device cpu|cuda`, overrides."""
    argv = list(argv)
    as_json = "--json" in argv
    argv = [x for x in argv if x != "--json"]
    opts = {}
    for flag in ("--ngpu", "--device", "--config"):
        if flag in argv:
            k = argv.index(flag)
            if k + 1 >= len(argv):
                raise SystemExit(f"{flag} needs a value")
            opts[flag] = argv[k + 1]
            del argv[k:k + 2]
    if "--ngpu" not in opts:
        raise SystemExit("usage: python -m trainer.memory_plan --config X.toml --ngpu N [--json] "
                         "[--device cpu|cuda] [--section.key value ...]")
    if "--config" in opts:
        argv = ["--job.config_file", opts["--config"]] + argv
    device = opts.get("--device", "cpu")
    if device not in ("cpu", "cuda"):
        raise SystemExit("--device must be cpu or cuda")
    result = plan(load_config(argv), int(opts["--ngpu"]), device)
    if as_json:
        print(json.dumps(result))
    else:
        _print(result)


if __name__ == "__main__":
    run_with_config_errors(main, sys.argv[1:])
