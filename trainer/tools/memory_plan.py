"""Memory plan: predict the per-rank peak of a training step before allocating anything.

`python -m trainer.memory_plan --config X.toml --ngpu N [--json] [--device cpu|cuda] [overrides...]`
(`--job.config_file X.toml` works too). For one rank per pipeline stage, `trainer.tools.dry_run` joins a fake process
group, builds the meshes, the pipeline split, EP and FSDP on a meta-device model and counts the rank's local
parameters; this module adds an analytic model of the step on top of those counts:

* state: parameters (fp32 master, local shards), gradients (same), AdamW state (2x parameters);
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
import sys

from parallelisms.moe_comm.registry import op_table
from parallelisms.pipeline import plan_stages
from core.config import ConfigError, run_with_config_errors
from trainer.tools.dry_run import report
from trainer.job_config import load_config, model_job, validate_job
from core.loss import chunk_rows
from core.memory_types import Item, Shape
from trainer.registry import get_model_spec

__all__ = ["plan", "main"]

_F32 = 4


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
    """The memory plan of one rank, from its dry-run row (`trainer.tools.dry_run.inspect_rank`)."""
    dims = validate_job(cfg, world_size)
    spec = get_model_spec(cfg.model.name)
    if spec.tools.memory_plan is None:
        raise ConfigError("model.name", f"model {cfg.model.name!r} has no memory plan")
    args = spec.build_args(model_job(cfg))
    bf16 = cfg.training.dtype == "bfloat16"
    a = 2 if bf16 else 4
    par = cfg.parallelism
    pp_rank = dry["coords"].get("pp", 0)
    names = None  # the whole model
    if dims.pp_enabled:
        stage_plan = plan_stages(spec.pipeline.units(args), dims.pp, pp_rank, par)
        names = [name for s in stage_plan.stage_ids for name in stage_plan.names[s]]
    B = par.pipeline_parallel_microbatch_size if dims.pp_enabled else cfg.training.local_batch_size
    sh = Shape(B, cfg.training.seq_len, a, device, dims.ep)
    shard = dims.dp_shard if dims.dp_enabled else 1
    pbytes = 2 if bf16 and dims.dp_enabled else 4  # FSDP gathers in param_dtype
    stage = spec.tools.memory_plan(args, cfg.moe, cfg.fp8, sh, names, pbytes, shard)
    first, last = stage.first, stage.last
    layer_ids = [b.layer for b in stage.blocks]
    ac = cfg.activation_checkpoint
    save_ops = set(op_table().save_ops(ac.save_ops)) | {"d2h_copy"}
    modes = _block_modes(cfg, layer_ids)
    notes = []
    if ac.recompute_modules:
        notes.append("recompute_modules is not modelled: estimated as mode none (an upper bound)")
        modes = {i: "none" for i in layer_ids}

    params = dry["param_bytes"]
    # per-block activations and backward working sets
    blocks = []
    for b in stage.blocks:
        kept, recomputed = _held(b.items, modes[b.layer], save_ops)
        blocks.append(dict(layer=b.layer, mode=modes[b.layer], kept=kept, recomputed=recomputed,
                           ffn_saved=b.ffn_saved, attn_ws=b.attn_ws, ffn_ws=b.ffn_ws, unit=b.unit_bytes,
                           grad=b.grad_bytes))

    n_micro = cfg.training.local_batch_size // B
    in_flight = 1
    if dims.pp_enabled:
        in_flight = n_micro if par.pipeline_parallel_schedule == "GPipe" else min(n_micro, dims.pp - pp_rank)
        notes.append(f"pipeline: {in_flight} microbatch(es) in flight assumed (1F1B warm-up depth)")

    head_kept = stage.head_kept if last else 0
    emb_kept = stage.embedding_kept if first else 0
    activations = in_flight * (sum(b["kept"] for b in blocks) + head_kept + emb_kept)
    unsaved_copies = 0
    if bf16 and not dims.dp_enabled:
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
    # (prefetch).
    fsdp = dims.dp_enabled and shard > 1
    largest_unit = max([b["unit"] for b in blocks] + ([stage.head_unit_bytes] if last else []) +
                       ([stage.embedding_unit_bytes] if first else []))
    fsdp_factor = 3 if fsdp else 0
    last_block_unit = blocks[-1]["unit"] if blocks else 0
    fsdp_loss = (3 * stage.head_unit_bytes + last_block_unit) if fsdp and last else 0

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
              "forward_end": activations + unsaved_copies + (2 * largest_unit if fsdp else 0)}
    grads_done = head_grad
    below = activations - head_kept  # the head's saved tensors are freed by the loss backward
    for b in reversed(blocks):
        below -= b["kept"]
        # + incoming and outgoing hidden-state gradients
        common = below + grads_done + b["grad"] + fsdp_factor * b["unit"] + 2 * stage.hidden_bytes
        block = b["kept"] + b["recomputed"]
        ffn_phase = common + block + b["ffn_ws"]
        attn_phase = common + block - b["ffn_saved"] + b["attn_ws"]
        phases[f"backward_layer_{b['layer']}"] = max(ffn_phase, attn_phase)
        grads_done += b["grad"]
    grads = dry["grad_bytes"]
    opt_state = dry["optimizer_bytes"]
    opt_transient = _optimizer_transient(cfg, params, stage.largest_local_param)
    fwd_bwd_peak = max(phases.values())
    optimizer_phase = grads + opt_transient
    buffers = stage.buffer_bytes
    peak = params + opt_state + buffers + max(fwd_bwd_peak, optimizer_phase)
    worst = max(phases, key=phases.get)
    transients = {"optimizer_step": opt_transient, "fsdp_all_gather_largest_unit": largest_unit if fsdp else 0,
                  "fsdp_backward": fsdp_factor * max([b["unit"] for b in blocks] + [0]),
                  "loss_logits_softmax": loss_transient, "ep_buffers": stage.ep_buffers,
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


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
