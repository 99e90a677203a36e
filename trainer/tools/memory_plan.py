"""Memory plan: predict the per-rank peak of a training step before allocating anything.

`python -m trainer.memory_plan --ngpu N [--config X.toml] [--json] [--device cpu|cuda] [--routing-skew F]
[overrides...]` (`--job.config_file X.toml` works too; without a config it plans the trainer's default,
`train_configs/debug_model.toml`, and without `--device` for this machine's device, as the trainer would run).
Analytic, for the first rank of every pipeline stage: the pipeline split is the trainer's own (`plan_stages`), the
rank's parameter shares come from the model's parameter shapes under EP and FSDP's dim-0 sharding (a test holds
them equal to the dry run's counts on the meta device), and on top of those:

* state: parameters (fp32 master, local shards), gradients (same), AdamW state (2x parameters; 1x with
  `optimizer.state_dtype = "bfloat16"`);
* activations held after forward under the activation-checkpointing policy, from the tensors each block creates
  (what autograd saves with no AC; block inputs for full AC; the outputs of `save_ops` for per-op selective);
* transients: the loss (logits and their fp32 softmax, in chunks for large logits), one block's backward
  (recompute under AC, gradient buffers, the attention score gradients), FSDP all-gathers and unsharded gradients,
  EP buffers, the optimizer's foreach temporaries (one tile, or the whole part).

Predicted peak (steady state, from step 2 on, when the AdamW state exists):

    params + optimizer_state + buffers + max(forward/backward peak, gradients + optimizer transient)

where the forward/backward peak walks the backward block by block: the activations of the blocks not yet
reached, plus the current block's recompute and working set, plus the gradients produced so far (see
docs/memory.md, "Memory plan").

This module is generic: the model package lists the tensors and sizes (the spec's `memory_plan` returns a
`StageMemory`; DeepSeek-V3's is `models/deepseek_v3/memory_plan.py`); here they are summed under the AC policy,
the pipeline schedule, FSDP and the optimizer.
"""

from __future__ import annotations

import json
import math
import sys

from collections.abc import Mapping

from parallelisms.activation_checkpoint.budget import (BudgetResult, LayerChoice, block_options, choose,
                                                       parse_per_layer, per_layer_entries)
from parallelisms.moe_comm.registry import get_comm_backend, op_table
from parallelisms.pipeline import plan_stages
from core.config import ConfigError, run_with_config_errors
from trainer.tools.dry_run import compact
from trainer.device import device_type
from trainer.job_config import load_command_config, model_job, validate_job
from core.loss import chunk_rows
from core.memory_types import Item, Shape
from quantization.fp8.accounting import FP8_DISPATCH_BYTES
from trainer.optimizer import STATE_DTYPES
from trainer.registry import get_model_spec
from trainer.stochastic_rounding import CHUNK_ELEMENTS, TRANSIENT_BYTES_PER_ELEMENT
from trainer.tools.step_time import Hardware, recompute_seconds

__all__ = ["budget_refusal", "choose_ac", "describe_choices", "plan", "main"]

_F32 = 4
GiB = 2 ** 30
#: the op the model's memory plan labels the MoE token exchange with (`Item.op`), whatever the comm backend
_EXCHANGE = "all_to_all"


COMPILE_NOTE = ("compile.enable: the eager peak, an upper bound for the compiled step (inductor recomputes pointwise "
                "ops in backward, e.g. SiLU, products and norms, instead of saving them: on an H200 at 16B shapes "
                "compiled peaks were 7-16% under eager, and this plan 13-23% over them; docs/memory.md)")
"""Why the plan of a compiled run is an upper bound: it models what eager autograd saves."""

_SUMS: dict[tuple, tuple] = {}
"""`_block_sums` by (item list, mode, save_ops): blocks of one kind share their item list."""


def _block_sums(items: list[Item], mode: str, save_ops: frozenset[str]) -> tuple[int, int, int, int, int]:
    """(kept, recomputed, recompute FLOPs, recomputed elementwise bytes, forward FLOPs) of one block's items under
    `mode`."""
    key = (id(items), mode, save_ops)
    if key not in _SUMS:
        if len(_SUMS) > 65536:
            _SUMS.clear()
        # the item list kept alive with the entry, so that its id is not reused while the entry exists
        _SUMS[key] = (items, *_held(items, mode, save_ops), *_recompute_work(items, mode, save_ops),
                      sum(i.flops for i in items))
    return _SUMS[key][1:]


def _held(items: list[Item], mode: str, save_ops: set[str]) -> tuple[int, int]:
    """(bytes kept after forward, bytes the backward recomputes) of one block under `mode`."""
    none_kept = sum(i.nbytes for i in items if i.saved)
    if mode == "none":
        return none_kept, 0
    if mode == "full":
        block_input = items[0].nbytes
        return block_input + sum(i.nbytes for i in items[1:] if i.op in save_ops), none_kept - block_input
    kept = sum(i.nbytes for i in items if i.op == "input" or i.op in save_ops)
    recomputed = sum(i.nbytes for i in items if i.saved and i.op != "input" and i.op not in save_ops)
    return kept, recomputed


def _exchange_ops(backend) -> tuple[str, ...]:
    """The op-table names that save the token exchange of comm backend class `backend`."""
    return (_EXCHANGE,) if backend.uses_all_to_all else tuple(backend.ac_ops)


def _plan_ops(names, backend) -> frozenset[str]:
    """Op-table names a policy saves -> the ops the plan's tensors are labelled with that it saves: the exchange
    when the backend's own exchange ops are saved (and not merely all_to_all, which such a backend never runs);
    host copies always, and the received routing when the backend's recompute reuses it (full AC too)."""
    names = set(names)
    exchange = _EXCHANGE if names & set(_exchange_ops(backend)) else None
    routing = "routing" if backend.recompute_reuses_routing else None
    return frozenset(names - {_EXCHANGE} | {exchange, routing, "d2h_copy"} - {None})


def _block_choices(cfg, layer_ids: list[int], per_layer: Mapping[int, LayerChoice] | None = None
                   ) -> dict[int, tuple[str, frozenset[str]]]:
    """AC per block: (none, full or op (per-op selective), the plan's ops whose tensors op saves); mode budget reads
    `per_layer` (default: the config's)."""
    ac = cfg.activation_checkpoint
    backend = get_comm_backend(cfg.parallelism.expert_parallel_comm_backend)
    if ac.mode == "budget":
        chosen = parse_per_layer(ac.per_layer) if per_layer is None else per_layer
        missing = [str(i) for i in layer_ids if i not in chosen]
        if missing:
            raise ConfigError("activation_checkpoint.per_layer", f"has no entry for layer(s) {', '.join(missing)}",
                              "one entry per layer (empty: chosen before launch)")
        return {i: (chosen[i].mode, _plan_ops(chosen[i].save_ops, backend)) for i in layer_ids}
    kept = _plan_ops((), backend)  # what full AC keeps besides the block's input
    if ac.mode == "selective" and ac.granularity == "layer":
        return {i: ("full", kept) if (i + 1) % ac.layer_freq == 0 else ("none", frozenset()) for i in layer_ids}
    if ac.mode == "selective":
        save_ops = _plan_ops(op_table().save_ops(ac.save_ops), backend)
        return {i: ("op", save_ops) for i in layer_ids}
    return {i: (ac.mode, kept if ac.mode == "full" else frozenset()) for i in layer_ids}


def _bf16_step_compiled(opt, device: str) -> bool:
    """Whether the optimizer step is `BF16MomentsAdamW`'s compiled kernel (fused, on CUDA: its `compiled`)."""
    return opt.state_dtype == "bfloat16" and opt.implementation == "fused" and device == "cuda"


def _clipping_bytes_per_param(cfg, device: str) -> int:
    """HBM traffic of gradient clipping per parameter (float32 gradients), as the trainer clips (`_clip_in_step`):
    the norm reads every gradient; then the compiled BF16-moment step divides in its kernel without writing back,
    torch's fused AdamW divides and writes the gradient back, and everything else scales in place (read and write)."""
    if cfg.training.max_norm <= 0:
        return 0
    if _bf16_step_compiled(cfg.optimizer, device):
        return 4
    if cfg.optimizer.implementation == "fused" and cfg.optimizer.state_dtype == "float32":
        return 4 + 4
    return 4 + 8


def _optimizer_transient(cfg, param_bytes: int, largest_local_param: int, device: str) -> int:
    """Foreach AdamW allocates one parameter-sized temporary per group; fused and for-loop almost nothing. With
    bf16 moments (`BF16MomentsAdamW`) the step holds float32 copies of both moments instead: of one tensor when
    it steps a tensor at a time eagerly (for-loop; fused off CUDA), of the group with foreach; none in the compiled
    fused kernel on CUDA. Eager stochastic rounding adds its temporaries for one chunk of the largest tensor."""
    opt = cfg.optimizer
    copies = 2 if opt.state_dtype == "bfloat16" else 1
    compiled = _bf16_step_compiled(opt, device)
    rounding = 0
    if copies == 2 and opt.state_rounding == "stochastic" and not compiled:
        rounding = min(largest_local_param // 4, CHUNK_ELEMENTS) * TRANSIENT_BYTES_PER_ELEMENT
    if opt.implementation == "fused":
        return 0 if copies == 1 or compiled else 2 * largest_local_param + rounding
    if opt.implementation == "for-loop":
        return copies * largest_local_param + rounding
    if opt.max_group_bytes > 0:
        return copies * min(param_bytes, max(opt.max_group_bytes, largest_local_param)) + rounding
    return copies * param_bytes + rounding


_STAGES: dict[tuple, tuple] = {}
"""Stage memories by (args, sections, shape, names, gathering): the planner asks for the same ones many times."""


def _stage_memory(spec, args, cfg, sh: Shape, names: list[str] | None, pbytes: int, shard: int):
    fp8 = cfg.fp8
    key = (spec.name, id(args), cfg.moe.aux_loss_coeff > 0, fp8.recipe, tuple(fp8.modules),
           tuple(fp8.exclude_modules), fp8.all_gather, sh, None if names is None else tuple(names), pbytes, shard)
    if key not in _STAGES:
        if len(_STAGES) > 4096:
            _STAGES.clear()
        # args kept alive with the entry, so that its id is not reused while the entry exists
        _STAGES[key] = (args, spec.tools.memory_plan(args, cfg.moe, cfg.fp8, sh, names, pbytes, shard))
    return _STAGES[key][1]


_SPLITS: dict[tuple, tuple] = {}


def _stage_names(spec, args, dims, pp_rank: int, par) -> tuple[list[str], list[str]]:
    """(the pipeline units of rank `pp_rank`'s stages, each stage's units compacted for printing)."""
    key = (spec.name, id(args), dims.pp, pp_rank, par.pipeline_parallel_schedule,
           par.pipeline_parallel_layers_per_stage, tuple(par.pipeline_parallel_module_fqns_per_stage))
    if key not in _SPLITS:
        if len(_SPLITS) > 65536:
            _SPLITS.clear()
        stage_plan = plan_stages(spec.pipeline.units(args), dims.pp, pp_rank, par)
        names = [name for s in stage_plan.stage_ids for name in stage_plan.names[s]]
        _SPLITS[key] = (args, names, [" ".join(compact(stage_plan.names[s])) for s in stage_plan.stage_ids])
    return _SPLITS[key][1:]


#: ops of the plan's tensors that communicate: the step-time model counts their recompute as communication
_COMMUNICATING = frozenset({_EXCHANGE, "all_gather"})


def _recompute_work(items: list[Item], mode: str, save_ops: set[str]) -> tuple[int, int]:
    """(forward FLOPs, bytes of elementwise outputs) the backward runs again: the whole block (full) or the ops the
    policy does not save (op). Elementwise: tensors made without FLOPs that do not communicate. The received
    routing is never made again: a backend that keeps it replays it, and one that does not never makes it."""
    if mode == "none":
        return 0, 0
    again = [i for i in items if i.op not in ("input", "routing") and (mode == "full" or i.op not in save_ops)]
    return (sum(i.flops for i in again),
            sum(i.nbytes for i in again if not i.flops and i.op not in _COMMUNICATING))


def _rank_stage(cfg, dims, pp_rank: int, device: str, skew: float, args):
    """(the model part of the first rank of stage `pp_rank`, its microbatch shape, its stages' units compacted for
    printing, FSDP's gather bytes per element)."""
    spec = get_model_spec(cfg.model.name)
    if spec.tools.memory_plan is None:
        raise ConfigError("model.name", f"model {cfg.model.name!r} has no memory plan")
    bf16 = cfg.training.dtype == "bfloat16"
    a = 2 if bf16 else 4
    par = cfg.parallelism
    names, stages = _stage_names(spec, args, dims, pp_rank, par) if dims.pp_enabled else (None, ["all"])
    B = par.pipeline_parallel_microbatch_size if dims.pp_enabled else cfg.training.local_batch_size
    # with context parallelism a rank holds seq_len / cp tokens of each sequence
    # FP8 dispatch where the config asks for it and the comm backend can (`quantize_dispatch` at run time)
    tile, backend = cfg.fp8.dispatch_tile, get_comm_backend(par.expert_parallel_comm_backend)
    wire = FP8_DISPATCH_BYTES if dims.ep > 1 and tile and backend.can_quantize_wire(tile) else 0.0
    sh = Shape(B, cfg.training.seq_len // dims.cp, a, device, dims.ep, skew if dims.ep > 1 else 1.0, dims.cp, wire,
               backend.dequantizes_in_op)
    shard = dims.fsdp_shard if dims.sharded else 1
    pbytes = 2 if bf16 and dims.sharded else 4  # FSDP gathers in param_dtype
    return _stage_memory(spec, args, cfg, sh, names, pbytes, shard), sh, stages, pbytes


def plan_rank(cfg, dims, pp_rank: int = 0, device: str = "cpu", skew: float = 1.0, args=None,
              per_layer: Mapping[int, LayerChoice] | None = None) -> dict:
    """The memory plan of the first rank of pipeline stage `pp_rank` (ranks of one stage hold equal shares), for
    the resolved degrees `dims` (`validate_job`), expert rows at `skew` times the balanced mean; `args`: the model
    args, when the caller has built them; `per_layer`: with AC mode budget, the choice per layer (default: the
    config's `per_layer`). Analytic: no process group, no model (its parameter shapes aside)."""
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg)) if args is None else args
    stage, sh, stages, pbytes = _rank_stage(cfg, dims, pp_rank, device, skew, args)
    bf16 = cfg.training.dtype == "bfloat16"
    a = 2 if bf16 else 4
    par = cfg.parallelism
    B = sh.B
    first, last = stage.first, stage.last
    layer_ids = [b.layer for b in stage.blocks]
    ac = cfg.activation_checkpoint
    choices = _block_choices(cfg, layer_ids, per_layer)
    notes = []
    if ac.recompute_modules:
        notes.append("recompute_modules is not modelled: estimated as mode none (an upper bound)")
        choices = {i: ("none", frozenset()) for i in layer_ids}
    modes = {i: mode for i, (mode, _) in choices.items()}
    if sh.skew != 1.0:
        notes.append(f"routing skew {sh.skew:g}: this EP rank's experts receive {sh.skew:g} x the mean rows")
    if cfg.compile.enable:
        notes.append(COMPILE_NOTE)

    params = stage.param_numel * 4
    # per-block activations and backward working sets
    blocks = []
    recompute = recompute_bytes = forward_flops = 0
    for b in stage.blocks:
        kept, recomputed, flops, elementwise, forward = _block_sums(b.items, *choices[b.layer])
        recompute += flops
        recompute_bytes += elementwise
        forward_flops += forward
        blocks.append(dict(layer=b.layer, mode=modes[b.layer], kept=kept, recomputed=recomputed,
                           ffn_saved=b.ffn_saved, attn_ws=b.attn_ws, ffn_ws=b.ffn_ws, unit=b.unit_bytes,
                           grad=b.grad_bytes))
    n_micro = cfg.training.local_batch_size // B
    in_flight = 1
    if dims.pp_enabled:
        schedule = par.pipeline_parallel_schedule
        if schedule == "GPipe":
            in_flight, why = n_micro, "GPipe: every forward before any backward"
        elif schedule in ("ZBVZeroBubble", "DualPipeV"):
            # a V rank holds a first-half and a second-half stage and defers weight gradients: up to pp + 1
            # microbatches' activations of its stages (DualPipe's bound)
            in_flight, why = min(n_micro, dims.pp + 1), "V schedule: pp + 1"
        else:
            in_flight, why = min(n_micro, dims.pp - pp_rank), "1F1B warm-up depth"
        notes.append(f"pipeline: {in_flight} microbatch(es) in flight assumed ({why})")

    head_kept = stage.head_kept if last else 0
    emb_kept = stage.embedding_kept if first else 0
    activations = in_flight * (sum(b["kept"] for b in blocks) + head_kept + emb_kept)
    unsaved_copies = 0
    if bf16 and not dims.sharded:
        # autocast caches a bf16 copy of every weight for the whole forward; the matmuls save them for backward,
        # but a checkpointed block (full or per-op) recasts its weights in the recompute instead
        saved_copies = sum(b["unit"] // 2 for b in blocks if b["mode"] == "none")
        saved_copies += stage.head_unit_bytes // 2 if last else 0
        unsaved_copies = params // 2 - saved_copies
        activations += saved_copies
        notes.append("bf16 without FSDP: autocast weight copies counted as activations (blocks without AC, head)")

    # FSDP, 3 units of the block in backward: while its backward runs, its parameters gathered again, the
    # previous unit prefetched and its unsharded gradients filling up; the reduce-scatter's copy of those
    # gradients comes after the block's backward, when its parameters and working set are freed. Forward holds 2
    # (prefetch). Without resharding after forward (`fsdp_reshard_after_forward`, the default with a pipeline)
    # every unit stays gathered from its forward to its backward.
    # FSDP wraps the model whenever there is data (or context) parallelism: with a shard degree of 1 (replicas
    # only) it still gathers into separate unsharded parameters and gradients
    fsdp = dims.sharded
    reshard = par.fsdp_reshard_after_forward == "always" or (par.fsdp_reshard_after_forward == "default"
                                                             and not dims.pp_enabled)
    keep_gathered = fsdp and not reshard
    emb_unit = stage.embedding_unit_bytes if first else 0
    head_unit = stage.head_unit_bytes if last else 0
    largest_unit = max([b["unit"] for b in blocks] + [head_unit, emb_unit])
    all_units = sum(b["unit"] for b in blocks) + head_unit + emb_unit
    fsdp_factor = 3 if fsdp else 0
    last_block_unit = blocks[-1]["unit"] if blocks else 0
    fsdp_loss = 0
    if fsdp and last:
        fsdp_loss = all_units + 2 * head_unit if keep_gathered else 3 * head_unit + last_block_unit

    # the loss: logits stay referenced while their fp32 softmax gradient and the nll gradient are built; chunked
    # (large logits, core/loss.py), the logits and their gradient plus one chunk's fp32 work and gradient
    head_grad = stage.head_grad_bytes if last else 0
    T, V = stage.logits
    rows = chunk_rows(T, V)
    if rows is None:
        loss_transient = T * V * a + 2 * T * V * _F32 + stage.hidden_bytes
    else:
        loss_transient = 2 * T * V * a + 3 * rows * V * _F32 + rows * V * a + stage.hidden_bytes
    loss_transient = loss_transient if last else 0
    # every in-flight microbatch's activations are alive when the last one's backward starts
    phases = {"loss_backward": activations + loss_transient + head_grad + fsdp_loss if last else 0,
              # the autocast cache holds every weight's copy until the forward ends
              "forward_end": activations + unsaved_copies + (
                  all_units if keep_gathered else 2 * largest_unit if fsdp else 0)}
    grads_done = head_grad
    below = activations - head_kept  # the head's saved tensors are freed by the loss backward
    gathered_below = all_units - head_unit  # units still gathered below the block (without resharding)
    for b in reversed(blocks):
        below -= b["kept"]
        gathered_below -= b["unit"]
        # its parameters and unsharded gradients, and every unit below still gathered
        fsdp_here = 2 * b["unit"] + gathered_below if keep_gathered else fsdp_factor * b["unit"]
        # + incoming and outgoing hidden-state gradients
        common = below + grads_done + b["grad"] + fsdp_here + 2 * stage.hidden_bytes
        block = b["kept"] + b["recomputed"]
        ffn_phase = common + block + b["ffn_ws"]
        attn_phase = common + block - b["ffn_saved"] + b["attn_ws"]
        phases[f"backward_layer_{b['layer']}"] = max(ffn_phase, attn_phase)
        grads_done += b["grad"]
    if fsdp and dims.pp_enabled and n_micro > 1:
        # torch's pipeline stages run every backward but the last microbatch's without gradient sync and without
        # resharding after backward, and reduce-scatter once all are done: from the first backward on, every unit
        # stays gathered and its unsharded gradients accumulate. The last microbatch's backward then walks with one
        # microbatch's activations left, and the reduce-scatter holds the unsharded and the sharded gradients.
        unsharded = all_units // pbytes * _F32
        below = sum(b["kept"] for b in blocks) + emb_kept
        for b in reversed(blocks):
            below -= b["kept"]
            common = below + all_units + unsharded + 2 * stage.hidden_bytes
            block = b["kept"] + b["recomputed"]
            phases[f"backward_last_microbatch_layer_{b['layer']}"] = max(
                common + block + b["ffn_ws"], common + block - b["ffn_saved"] + b["attn_ws"])
        # a rank's stages reduce one after the other: the first holds its sharded gradients beside everything
        phases["reduce_scatter"] = all_units + unsharded + params // len(stages)
        notes.append("pipeline with FSDP: gradients reduce-scattered after the last microbatch (units stay gathered)")
    grads = params
    moment_bytes = STATE_DTYPES[cfg.optimizer.state_dtype].itemsize
    opt_state = 2 * moment_bytes * stage.param_numel
    opt_transient = _optimizer_transient(cfg, params, stage.largest_local_param, device)
    fwd_bwd_peak = max(phases.values())
    optimizer_phase = grads + opt_transient
    buffers = stage.buffer_bytes
    peak = params + opt_state + buffers + max(fwd_bwd_peak, optimizer_phase)
    worst = max(phases, key=phases.get)
    transients = {"optimizer_step": opt_transient, "fsdp_all_gather_largest_unit": largest_unit if fsdp else 0,
                  "fsdp_backward": fsdp_factor * max([b["unit"] for b in blocks] + [0]),
                  "loss_logits_softmax": loss_transient, "ep_buffers": stage.ep_buffers,
                  "backward_working_set": phases[worst] - activations}
    # what the step-time model needs (`trainer.tools.step_time`), per microbatch of this rank's stages
    forward_flops += stage.head_flops if last else 0
    units = [b.unit_bytes for b in stage.blocks] + ([stage.head_unit_bytes] if last else []) + \
        ([stage.embedding_unit_bytes] if first else [])
    # the head and the embedding are never FP8: gathered in the param dtype
    unit_elements = [b.unit_elements for b in stage.blocks] + [u // pbytes for u in units[len(stage.blocks):]]
    backend = get_comm_backend(par.expert_parallel_comm_backend)
    hidden = stage.hidden_bytes // (sh.T * a)
    comm_buffers = backend.planned_buffer_bytes(hidden * max(a, 2), dims.ep) if dims.ep_enabled else 0
    def again(layer: int, op: str) -> bool:  # whether the backward of block `layer` runs `op`'s tensors again
        mode, save_ops = choices[layer]
        return mode == "full" or (mode == "op" and op not in save_ops)

    # context parallelism's gathers: items of their own only with cp > 1 (not scanned otherwise: the planner plans
    # thousands of ranks)
    cp_items = [(b.layer, it) for b in stage.blocks for it in b.items if it.name.startswith("cp.")] if sh.cp > 1 else []
    work = {"forward_flops": forward_flops, "recompute_flops": recompute, "recompute_memory_bytes": recompute_bytes,
            "microbatches": n_micro, "stages_per_rank": len(stages),
            "a2a_bytes": sum(b.a2a_bytes for b in stage.blocks),
            "a2a_grad_bytes": sum(b.a2a_grad_bytes for b in stage.blocks),
            "a2a_recomputed_bytes": sum(b.a2a_bytes for b in stage.blocks if again(b.layer, _EXCHANGE)),
            "cp_bytes": sum(it.nbytes for _, it in cp_items),
            "cp_recomputed_bytes": sum(it.nbytes for layer, it in cp_items if again(layer, it.op)),
            "fsdp_unit_bytes": units if fsdp else [], "fsdp_unit_elements": unit_elements if fsdp else [],
            "fp8_gathered_elements": sum(b.fp8_gathered for b in stage.blocks) if fsdp else 0,
            "fp8_gathered_shard_elements": sum(b.fp8_gathered_shard for b in stage.blocks) if fsdp else 0,
            "hidden_bytes": stage.hidden_bytes,
            "grad_bytes": grads, "param_count": stage.param_numel, "token_bytes": hidden * max(a, 2),
            # AdamW's traffic per parameter: weights read and written, the gradient read, both moments read and
            # written; plus gradient clipping's
            "optimizer_bytes_per_param": 3 * 4 + 4 * moment_bytes + _clipping_bytes_per_param(cfg, device)}
    return {
        "rank": pp_rank * (dims.world_size // dims.pp), "coords": {"pp": pp_rank, "dp_replicate": 0, "efsdp": 0,
                                                                   "ep": 0, "cp": 0},
        "stages": stages, "layers": layer_ids,
        "ac_modes": sorted(set(modes.values())), "microbatch": [B, sh.S], "microbatches_in_flight": in_flight,
        "routing_skew": sh.skew, "comm_buffer_bytes": comm_buffers, "work": work,
        "params": stage.param_numel, "parameter_bytes": params, "gradient_bytes": grads,
        "optimizer_state_bytes": opt_state, "buffer_bytes": buffers, "activation_bytes": activations,
        "transients": transients,
        "largest_transient": max(transients, key=transients.get),
        "forward_backward_peak_bytes": fwd_bwd_peak, "forward_backward_peak_at": worst,
        "optimizer_phase_bytes": optimizer_phase,
        "peak_phase": "optimizer_step" if optimizer_phase >= fwd_bwd_peak else worst,
        "predicted_peak_bytes": peak, "upper_bound": bool(cfg.compile.enable or ac.recompute_modules), "notes": notes,
    }


_OPTIONS: dict[tuple, tuple] = {}
"""`block_options` by (item list, comm backend, EP and CP degrees, hardware): blocks of one kind share their item
list, and the layout planner asks for the same ones many times."""


def _options(items: list[Item], backend: str, dims, hw: Hardware) -> list:
    key = (id(items), backend, dims.ep, dims.cp, hw)
    if key not in _OPTIONS:
        if len(_OPTIONS) > 4096:
            _OPTIONS.clear()
        kept = _plan_ops((), get_comm_backend(backend))  # kept by every AC choice: host copies, reused routing
        # the item list kept alive with the entry, so that its id is not reused while the entry exists
        _OPTIONS[key] = (items, block_options(
            items, _savable(backend), lambda mode, ops: _held(items, mode, ops | kept),
            lambda item: recompute_seconds(item.op, item.flops, item.nbytes, dims, backend, hw)))
    return _OPTIONS[key][1]


def choose_ac(cfg, dims, device: str, skew: float, budget: int, args=None, hw: Hardware = Hardware(),
              quick: bool = False) -> BudgetResult:
    """AC mode budget: the choice per layer of least predicted recompute time (`step_time.recompute_seconds` with
    `hw`) whose planned peak fits `budget` bytes on every pipeline stage's first rank, comm backend buffers
    included (`parallelisms.activation_checkpoint.budget.choose`, `quick` as there; `fits` false when even full AC
    does not)."""
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg)) if args is None else args
    backend = cfg.parallelism.expert_parallel_comm_backend
    stage_layers, options = [], {}
    for p in range(dims.pp):
        blocks = _rank_stage(cfg, dims, p, device, skew, args)[0].blocks
        stage_layers.append([b.layer for b in blocks])
        options.update({b.layer: _options(b.items, backend, dims, hw) for b in blocks})
    planned: dict[tuple, int] = {}

    def peak(p: int, choices: Mapping[int, LayerChoice]) -> int:
        # a stage's plan depends on its own layers' choices only
        key = (p, *(choices[i] for i in stage_layers[p]))
        if key not in planned:
            r = plan_rank(cfg, dims, p, device, skew, args, choices)
            planned[key] = r["predicted_peak_bytes"] + r["comm_buffer_bytes"]
        return planned[key]

    return choose(stage_layers, options, peak, budget, quick)


def _savable(backend: str) -> dict[str, tuple[str, ...]]:
    """Each op the plan labels tensors with that a policy can save -> the op-table names that save it with comm
    backend `backend` (the token exchange: all_to_all, or the backend's own ops)."""
    names = {op: (op,) for op in op_table().ops if op not in ("d2h_copy", _EXCHANGE)}
    names[_EXCHANGE] = _exchange_ops(get_comm_backend(backend))
    return names


def describe_choices(cfg, dims, device: str, skew: float, args, choices: Mapping[int, LayerChoice]) -> list[str]:
    """One line per layer of an AC choice (`choose_ac`): what the block saves and what its backward recomputes."""
    names = _savable(cfg.parallelism.expert_parallel_comm_backend)
    lines = []
    for p in range(dims.pp):
        for b in _rank_stage(cfg, dims, p, device, skew, args)[0].blocks:
            choice = choices[b.layer]
            if choice.mode == "none":
                what = "no AC: keeps what autograd saves, recomputes nothing"
            elif choice.mode == "full":
                what = "full: keeps its input, recomputes everything"
            else:
                ops = dict.fromkeys(name for item in b.items if item.op in names for name in names[item.op])
                again = [op for op in ops if op not in choice.save_ops] + ["the unnamed ops"]
                what = f"saves {', '.join(choice.save_ops)}; recomputes {', '.join(again)}"
            lines.append(f"layer {b.layer}: {what}")
    return lines


def budget_refusal(result: BudgetResult, budget_gib: float, skew: float) -> ConfigError:
    """The one-line refusal of a budget that even full AC on every block cannot meet (`choose_ac`'s `result`)."""
    # rounded up: a budget of the size named does fit
    need = math.ceil(result.peak / GiB * 1000) / 1000
    return ConfigError("activation_checkpoint.memory_budget_gib",
                       f"{budget_gib:g} GiB is below the smallest planned peak, {result.peak / GiB:.3f} GiB with full "
                       f"AC on every block (worst rank, expert rows at routing skew {skew:g})",
                       f">= {need:.3f} GiB, or fewer activations per rank (a smaller batch or more ranks)")


def plan(cfg, world_size: int, device: str = "cpu", skew: float = 1.0) -> dict:
    """The memory plan of every representative rank (the first rank of each pipeline stage). AC mode budget without
    `per_layer` is chosen here for `memory_budget_gib` (`choose_ac`); the choice is in `per_layer`."""
    dims = validate_job(cfg, world_size)
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg))
    ac = cfg.activation_checkpoint
    choices = None
    if ac.mode == "budget" and not ac.per_layer:
        if not ac.memory_budget_gib:
            raise ConfigError("activation_checkpoint.memory_budget_gib", "0 (the device's memory) is known only at "
                              "launch", "a number of GiB to plan for")
        result = choose_ac(cfg, dims, device, skew, int(ac.memory_budget_gib * GiB), args)
        if not result.fits:
            raise budget_refusal(result, ac.memory_budget_gib, skew)
        choices = result.choices
    ranks = [plan_rank(cfg, dims, p, device, skew, args, choices) for p in range(dims.pp)]
    per_layer = per_layer_entries(choices) if choices is not None else list(ac.per_layer)
    return {"model": f"{cfg.model.name}/{cfg.model.flavor}", "world_size": world_size, "device": device,
            "activation_checkpoint": ac.mode, "routing_skew": skew, "ranks": ranks,
            **({"per_layer": per_layer} if ac.mode == "budget" else {})}


def _print(result: dict) -> None:
    gib = 2 ** 30
    print(f"memory plan: {result['model']} on {result['world_size']} ranks ({result['device']}, "
          f"AC {result['activation_checkpoint']})")
    if "per_layer" in result:
        print(f"AC per layer: {' '.join(result['per_layer'])}")
    for r in result["ranks"]:
        print(f"rank {r['rank']:>5} {r['coords']}  stages: {'; '.join(r['stages'])}")
        print(f"    params {r['parameter_bytes'] / gib:.3f} GiB  grads {r['gradient_bytes'] / gib:.3f} GiB  "
              f"AdamW {r['optimizer_state_bytes'] / gib:.3f} GiB  activations {r['activation_bytes'] / gib:.3f} GiB")
        big = ", ".join(f"{k} {v / gib:.3f}" for k, v in r["transients"].items() if v)
        print(f"    transients (GiB): {big}")
        print(f"    predicted peak {r['predicted_peak_bytes'] / gib:.3f} GiB, at {r['peak_phase']}")
        for note in r["notes"]:
            print(f"    note: {note}")


_USAGE = ("python -m trainer.memory_plan --ngpu N [--config X.toml] [--json] [--device cpu|cuda] "
          "[--routing-skew F] [--section.key value ...]")


def main(argv: list[str]) -> None:
    """CLI: `--ngpu N`, `--config X.toml` (or `--job.config_file`; default: the trainer's, `DEFAULT_CONFIG_FILE`),
    `--json`, `--device cpu|cuda` (default: this machine's, as the trainer), overrides."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    as_json = "--json" in argv
    argv = [x for x in argv if x != "--json"]
    opts = {}
    for flag in ("--ngpu", "--device", "--config", "--routing-skew"):
        if flag in argv:
            k = argv.index(flag)
            if k + 1 >= len(argv):
                raise ConfigError(flag, "needs a value", _USAGE)
            opts[flag] = argv[k + 1]
            del argv[k:k + 2]
    if "--ngpu" not in opts:
        raise ConfigError("--ngpu", "is missing", _USAGE)
    if "--config" in opts:
        argv = ["--job.config_file", opts["--config"]] + argv
    device = opts.get("--device", device_type())
    if device not in ("cpu", "cuda"):
        raise ConfigError("--device", f"{device!r} is not a device", "cpu, cuda")
    result = plan(load_command_config(argv), int(opts["--ngpu"]), device, float(opts.get("--routing-skew", 1.0)))
    if as_json:
        print(json.dumps(result))
    else:
        _print(result)


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
