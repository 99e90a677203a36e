"""DeepSeek-V3 model package: registers its `ModelSpec` with the trainer's registry on import."""

from __future__ import annotations

import torch

from quantization.fp8.config import fp8_config_problem, fp8_selection, selected_modules
from core.config import ConfigError
from core.loss import IGNORE_INDEX, cross_entropy_sum
from core.model_config import MoESection
from core.model_spec import (Checkpoints, ModelJob, ModelSpec, PipelineSplit, PlanTables, ToolHooks,
                             TrainingHooks, register_model_spec)

from .args import FLAVORS, ModelArgs
from . import hf
from .flops import block_flops_per_token, count_params, training_flops_per_token
from .hf import load_hf_pretrained
from .memory_plan import stage_memory
from .model import DeepSeekV3Model, TransformerBlock
from .moe import update_expert_bias
from .parallelize import (MODULE_DEFAULTS, RECOMPUTE_MODULES, compile_problem, compile_units,
                          parallelize_deepseek_v3)
from .pipeline import keep_stage, split_units


def build_args(job: ModelJob) -> ModelArgs:
    """Model args for the job: the flavor (or a HF config.json) with `model.n_layers` / `model.n_dense_layers`
    applied, adapted to the job's MoE switches."""
    model_cfg = job.model
    if model_cfg.hf_config_path:
        try:
            args = hf.args_from_hf_config_file(model_cfg.hf_config_path)
        except (OSError, ValueError) as e:
            raise ConfigError("model.hf_config_path", str(e)) from None
    elif model_cfg.flavor in FLAVORS:
        args = FLAVORS[model_cfg.flavor]
    else:
        raise ConfigError("model.flavor", f"unknown flavor {model_cfg.flavor!r}", ", ".join(FLAVORS))
    args = _override_layers(args, model_cfg).replace(use_grouped_mm=job.moe.use_grouped_mm)
    seq_len = job.seq_len
    if seq_len > args.max_seq_len:
        raise ConfigError("training.seq_len", f"{seq_len} exceeds the model's maximum of {args.max_seq_len}",
                          f"1..{args.max_seq_len}, or raise model.max_seq_len (YaRN past the pre-training context)")
    ep = job.expert_parallel_degree
    if args.n_routed_experts % ep:
        raise ConfigError("parallelism.expert_parallel_degree",
                          f"{ep} does not divide the {args.n_routed_experts} routed experts",
                          ", ".join(str(d) for d in range(1, args.n_routed_experts + 1)
                                    if args.n_routed_experts % d == 0))
    if job.pipeline_parallel_degree > 1 and args.num_mtp_layers > 0:
        raise ConfigError("parallelism.pipeline_parallel_degree",
                          f"multi-token prediction ({args.num_mtp_layers} MTP layers) needs the embedding and "
                          "the head on one stage", "1 when the model has MTP layers, or model.mtp_layers = 0")
    problem = compile_problem(args)
    if job.compile_model and problem is not None:
        raise ConfigError("moe.use_grouped_mm", problem, "true with compile.components containing model")
    _check_fp8(job.fp8, args)
    return args


def _override_layers(args: ModelArgs, model_cfg) -> ModelArgs:
    """`model.n_layers` / `model.n_dense_layers` / `model.mtp_layers` / `model.max_seq_len` applied to the flavor's
    args (0 / -1 / -1 / 0 keep the flavor's)."""
    if model_cfg.mtp_layers != -1:
        args = args.replace(num_mtp_layers=model_cfg.mtp_layers)
    if model_cfg.max_seq_len:
        args = args.replace(max_seq_len=model_cfg.max_seq_len)
    n_layers = model_cfg.n_layers or args.n_layers
    if model_cfg.n_dense_layers != -1:
        if model_cfg.n_dense_layers > n_layers:
            raise ConfigError("model.n_dense_layers", f"{model_cfg.n_dense_layers} exceeds the model's {n_layers} "
                              "layers", f"0..{n_layers}, or -1 for the flavor's")
        return args.replace(n_layers=n_layers, n_dense_layers=model_cfg.n_dense_layers)
    if args.n_dense_layers > n_layers:
        raise ConfigError("model.n_layers", f"{n_layers} is fewer than the flavor's {args.n_dense_layers} dense "
                          "layers", f">= {args.n_dense_layers}, or set model.n_dense_layers <= {n_layers} too")
    return args.replace(n_layers=n_layers)


def _check_fp8(fp8_cfg, args: ModelArgs) -> None:
    """The [fp8] dims against one block of each kind the model has (dense, MoE), its names against both kinds
    (so the default names hold for a model without dense layers); blocks built on the meta device. FP8 experts
    need the grouped GEMM (`moe.use_grouped_mm`)."""
    layer_ids = sorted({0, args.n_dense_layers} & set(range(args.n_layers)))
    both_kinds = args.replace(n_dense_layers=1)
    with torch.device("meta"):
        blocks = [TransformerBlock(i, args) for i in layer_ids]
        vocabulary = [TransformerBlock(i, both_kinds) for i in (0, 1)]
    selection = fp8_selection(fp8_cfg, MODULE_DEFAULTS)
    problem = fp8_config_problem(selection, blocks, vocabulary=vocabulary)
    if problem is not None:
        raise ConfigError(*problem)
    grouped = [fqn for fqn, m in selected_modules(selection, blocks).items() if not isinstance(m, torch.nn.Linear)]
    if selection.recipe != "none" and grouped and not args.use_grouped_mm:
        raise ConfigError("moe.use_grouped_mm", "false, but FP8 experts run on the grouped GEMM",
                          f"true with fp8.recipe != none, or exclude {grouped[0]} in fp8.exclude_modules")


def build_loss_fn(args: ModelArgs, context_parallel=None):
    """Summed cross-entropy; with MTP, plus the weighted MTP losses (see `mtp_loss`). With `context_parallel`, the
    loss gets the whole sequences' labels and this rank's share of the outputs."""
    if args.num_mtp_layers > 0:
        return lambda output, labels: mtp_loss(output, labels, args.mtp_loss_weight, context_parallel)
    if context_parallel is None:
        return cross_entropy_sum
    return lambda output, labels: cross_entropy_sum(output, _own_share(context_parallel, labels))


def configure_model(model: DeepSeekV3Model, moe_cfg: MoESection) -> None:
    """The sequence-wise aux-loss weight (`moe.aux_loss_coeff`) on every MoE layer of the freshly built model."""
    for moe in model.moe_layers():
        moe.aux_loss_coeff = moe_cfg.aux_loss_coeff


def before_step(model_parts, global_tokens: int) -> None:
    """The aux loss's gradient scale for this step: 1 / global valid tokens, the LM loss's normalisation."""
    for part in model_parts:
        for moe in part.moe_layers():
            moe.aux_loss_grad_scale = 1.0 / max(global_tokens, 1)


def post_optimizer_step(model_parts, moe_cfg: MoESection, dp_group) -> dict[str, torch.Tensor]:
    """Aux-loss-free expert-bias update (once per optimizer step) and the routing statistics to log, as device
    tensors (the trainer reads them with its other step values, in one transfer on a logging step): 0-d scalars,
    and each layer's tokens per expert over the data-parallel group (1-D, the trainer's heatmap of the experts'
    load)."""
    moe_layers = [m for part in model_parts for m in part.moe_layers()]
    layer_ids = [m.layer_id for m in moe_layers]
    counts_LE = update_expert_bias(moe_layers, moe_cfg.load_balance_coeff, dp_group)
    names, values = [], []
    for layer_id, counts_E, moe in zip(layer_ids, counts_LE, moe_layers):
        names.append(f"moe/layer_{layer_id}/max_over_mean")
        values.append(counts_E.max() / counts_E.mean().clamp_min(1e-9))
        ep = moe.dispatcher.ep
        if ep > 1:
            # rows the busiest EP rank's experts received over the mean: the layout planner's --routing-skew
            per_rank = counts_E.float().view(ep, -1).sum(1)
            names.append(f"moe/layer_{layer_id}/ep_rank_max_over_mean")
            values.append(per_rank.max() / per_rank.mean().clamp_min(1e-9))
        names.append(f"moe/layer_{layer_id}/bias_range")
        values.append(moe.expert_bias.max() - moe.expert_bias.min())
        names.append(f"moe/layer_{layer_id}/tokens_per_expert")
        values.append(counts_E)
    return dict(zip(names, values))


def _own_share(context_parallel, t: torch.Tensor) -> torch.Tensor:
    """This rank's share of whole sequences `t` [B, S] (all of it without context parallelism)."""
    return t if context_parallel is None else context_parallel.shard(t)


def mtp_loss(output: torch.Tensor, labels: torch.Tensor, weight: float, context_parallel=None) -> torch.Tensor:
    """Summed main loss + weight / D * sum of the D MTP losses, for output [1 + D, B, S, V] in training.

    Depth k predicts labels shifted left by k (token t_{i+k+1} at position i); the last k positions of each
    sequence have no target and are ignored. In eval mode the model returns plain logits [B, S, V]. With
    `context_parallel`, `labels` are the whole sequences' and the output this rank's share: labels are shifted
    first, then sharded.
    """
    if output.dim() == 3:
        return cross_entropy_sum(output, _own_share(context_parallel, labels))
    depth = output.shape[0] - 1
    total = cross_entropy_sum(output[0], _own_share(context_parallel, labels))
    mtp_total = 0.0
    for k in range(1, depth + 1):
        shifted = torch.roll(labels, shifts=-k, dims=1)
        shifted[:, -k:] = IGNORE_INDEX
        mtp_total = mtp_total + cross_entropy_sum(output[k], _own_share(context_parallel, shifted))
    return total + (weight / depth) * mtp_total


def counts(args: ModelArgs, seq_len: int) -> tuple[int, int, float]:
    """(total params, active params, training FLOPs per token)."""
    c = count_params(args)
    return c.total, c.active, training_flops_per_token(args, seq_len)


register_model_spec(ModelSpec(
    name="deepseek_v3",
    model_cls=DeepSeekV3Model,
    build_args=build_args,
    parallelize=parallelize_deepseek_v3,
    build_loss_fn=build_loss_fn,
    param_and_flop_counts=counts,
    hooks=TrainingHooks(configure_model=configure_model, before_step=before_step,
                        post_optimizer_step=post_optimizer_step),
    pipeline=PipelineSplit(units=split_units, stage=keep_stage),
    checkpoints=Checkpoints(hf=hf, optional_weights={"mtp.": "--model.mtp_layers 0"}),
    plan=PlanTables(recompute_modules=RECOMPUTE_MODULES, module_defaults=MODULE_DEFAULTS, compile_units=compile_units),
    tools=ToolHooks(memory_plan=stage_memory, module_flops=block_flops_per_token),
    context_parallel=True,
))

__all__ = ["DeepSeekV3Model", "ModelArgs", "FLAVORS", "build_args", "load_hf_pretrained"]
