"""Everything a run derives from its config before the process group exists, so that a mistake ends with one line
and nothing written: the degrees against the world size, the model's args, the tokenizer, the data (its first
document read) and any checkpoint to resume or load (metadata, file sizes, weight names and shapes). Preflight
(`python -m trainer.preflight`) runs it once before torchrun; every rank runs it again.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from typing import Any

import torch

from core.config import ConfigError, config_to_toml
from core.model_spec import ModelSpec
from parallelisms.activation_checkpoint.config import save_ops_warning
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import schedule_problem
from trainer import device as devices
from trainer.checkpoint.files import CheckpointError, latest_checkpoint
from trainer.checkpoint.manager import saved_loader_state
from trainer.checkpoint.weights import WeightMismatch, check_checkpoint
from trainer.data.for_job import build_loader, hold_out_every
from trainer.data.loader import GlobalOrderLoader
from trainer.data.pretokenized import PretokenizedLoader
from trainer.job_config import JobConfig, model_job, validate_job
from trainer.registry import available_models, get_model_spec
from trainer.tokenizer import Tokenizer, build_tokenizer
from trainer.tools.plan import check_model, choose_layout, resolve_ac_budget

__all__ = ["Prepared", "prepare", "warn_settings_without_effect"]

logger = logging.getLogger("trainer")


@dataclasses.dataclass
class Prepared:
    """Everything derived from the config before the process group exists (so failures write nothing)."""

    cfg: JobConfig
    dims: ParallelDims
    spec: ModelSpec
    model_args: Any
    tokenizer: Tokenizer
    train_loader: GlobalOrderLoader
    val_loader: GlobalOrderLoader | None
    checkpoint_note: str | None = None  # what a partial checkpoint load skips, logged once by rank 0
    auto_layout: str | None = None  # the layout `parallelism.auto` chose, in one line
    batch_note: str | None = None  # a resume keeps its checkpoint's global batch: the line that says so
    ac_budget: list[str] | None = None  # AC mode budget: the budget, planned peak and choice per layer, as lines

    def config_text(self) -> str:
        """The merged config as TOML, with AC mode budget's choice explained in comments at its end."""
        return config_to_toml(self.cfg) + "".join(f"# {line}\n" for line in self.ac_budget or [])


def prepare(cfg: JobConfig, world_size: int, rank: int) -> Prepared:
    """Validate the job against the world size and build the host-side pieces; raise ConfigError on bad input.
    With `parallelism.auto` the layout planner chooses the layout first (`Prepared.cfg` holds it): every rank
    chooses the same, from the same config and memory. With `activation_checkpoint.mode = "budget"` the choice per
    layer is made here too (`resolve_ac_budget`), and `Prepared.cfg` holds it in `per_layer`."""
    auto_layout = None
    own_config = _hf_checkpoint_config(cfg)
    if own_config is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_config_path=own_config))
    if cfg.parallelism.auto:
        cfg, auto_layout = _auto_layout(cfg, world_size)
    dims = validate_job(cfg, world_size)
    schedule = schedule_problem(cfg.parallelism.pipeline_parallel_schedule, devices.device_type())
    if dims.pp_enabled and schedule is not None:
        raise ConfigError(*schedule)
    ac_budget = None
    if cfg.activation_checkpoint.mode == "budget":
        cfg, ac_budget = _ac_budget(cfg, world_size)
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError:
        raise ConfigError("model.name", f"unknown model {cfg.model.name!r}", ", ".join(available_models()))
    if cfg.checkpoint.initial_load_in_hf and spec.checkpoints.hf is None:
        raise ConfigError("checkpoint.initial_load_in_hf", f"model {cfg.model.name!r} cannot read Hugging Face "
                          "checkpoints", "false")
    if dims.pp_enabled and spec.pipeline is None:
        raise ConfigError("parallelism.pipeline_parallel_degree", f"model {cfg.model.name!r} has no pipeline split",
                          "1")
    try:
        model_args = spec.build_args(model_job(cfg))
    except ConfigError as e:
        if e.key != "model.hf_config_path" or own_config is None:
            raise
        # the user set no model.hf_config_path: the config at fault is the checkpoint's own
        raise ConfigError("checkpoint.initial_load_path", e.problem, e.allowed) from None
    tokenizer = job_tokenizer(cfg)
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ConfigError("tokenizer.path", f"tokenizer vocab {tokenizer.vocab_size} exceeds the model's "
                          f"vocab_size {model_args.vocab_size}", f"a tokenizer with <= {model_args.vocab_size} ids")
    dp_rank = (rank // dims.cp) % dims.dp  # meshes are laid out (pp, dp_replicate, dp_shard, cp), pp outermost
    global_batch, batch_note = _global_batch(cfg, dims)
    loader_args = dict(tokenizer=tokenizer, seq_len=cfg.training.seq_len, global_batch_size=global_batch,
                       dp_rank=dp_rank, dp_degree=dims.dp)
    hold_out = hold_out_every(cfg)
    train_loader = build_loader(cfg, loader_args, hold_out, validation=False)
    val_loader = build_loader(cfg, loader_args, hold_out, validation=True) if cfg.validation.enable else None
    note = _check_checkpoints(cfg, spec, model_args)
    _check_resumed_position(cfg, train_loader)
    return Prepared(cfg, dims, spec, model_args, tokenizer, train_loader, val_loader, note, auto_layout, batch_note,
                    ac_budget)


def job_tokenizer(cfg: JobConfig) -> Tokenizer:
    """The tokenizer `tokenizer.path` names; a file that is not one is a ConfigError on that key."""
    try:
        return build_tokenizer(cfg.tokenizer.path)
    except ValueError as e:
        raise ConfigError("tokenizer.path", str(e))


def _global_batch(cfg: JobConfig, dims: ParallelDims) -> tuple[int, str | None]:
    """Sequences per step, and the line that says where they come from when it is not what the config says: with
    `training.global_batch_size = -1`, a resume keeps its checkpoint's global batch (the layout may have changed
    since; gradient accumulation covers the difference), so the loss curve goes on as the checkpoint's run would
    have; a fresh run uses local_batch_size x the data-parallel degree."""
    lbs, per_step = cfg.training.local_batch_size, cfg.training.local_batch_size * dims.dp
    if cfg.training.global_batch_size != -1:
        return cfg.training.global_batch_size, None
    try:
        resume = latest_checkpoint(cfg.checkpoint, cfg.job.dump_folder)
    except CheckpointError:
        return per_step, None  # `_check_checkpoints` reports it
    saved = (saved_loader_state(resume) or {}).get("global_batch_size") if resume is not None else None
    if saved is None or saved == per_step:
        return per_step, None
    if saved % per_step:
        raise ConfigError("training.global_batch_size", f"-1 keeps the global batch of the checkpoint {resume}, "
                          f"{saved} sequences, which is not a multiple of local_batch_size {lbs} x data-parallel "
                          f"degree {dims.dp} = {per_step}", f"a local_batch_size x data-parallel degree that divides "
                          f"{saved}, or a global_batch_size that is a multiple of {per_step} (a new global batch)")
    return saved, (f"training.global_batch_size = -1: keeping the checkpoint's global batch of {saved} sequences "
                   f"per step (local_batch_size {lbs} x data-parallel degree {dims.dp} x {saved // per_step} "
                   "gradient accumulation steps); set training.global_batch_size to change it")


def _auto_layout(cfg: JobConfig, world_size: int) -> tuple[JobConfig, str]:
    """`cfg` with the layout the planner chooses for this machine's memory (`parallelism.auto_device_memory_gib`,
    or measured), and the line that names it."""
    check_model(cfg)
    gib = cfg.parallelism.auto_device_memory_gib or devices.memory_per_rank_bytes(world_size) / 2 ** 30
    return choose_layout(cfg, world_size, gib, devices.device_type())


def _ac_budget(cfg: JobConfig, world_size: int) -> tuple[JobConfig, list[str]]:
    """`cfg` with AC mode budget's choice per layer (`memory_budget_gib`, or 0: this device's memory per rank), and
    the lines that show it."""
    check_model(cfg)
    gib = devices.memory_per_rank_bytes(world_size) / 2 ** 30
    return resolve_ac_budget(cfg, world_size, gib, devices.device_type())


def _hf_checkpoint_config(cfg: JobConfig) -> str | None:
    """The config.json the model is built from when `checkpoint.initial_load_in_hf` is set and
    `model.hf_config_path` is not: the checkpoint's own (when it has one), whose shapes its weights have, not the
    flavor's."""
    own = os.path.join(cfg.checkpoint.initial_load_path, "config.json")
    if not cfg.checkpoint.initial_load_in_hf or cfg.model.hf_config_path or not os.path.isfile(own):
        return None
    return own


def _hf_config_hint(cfg: JobConfig) -> str:
    """Why a HF checkpoint's weights may not fit the model: the model's config is not the checkpoint's own."""
    path, chosen = cfg.checkpoint.initial_load_path, cfg.model.hf_config_path
    own = os.path.join(path, "config.json")
    if not os.path.isfile(own):
        source = f"model.hf_config_path {chosen}" if chosen else f"model.flavor {cfg.model.flavor!r}"
        return (f"; {path} has no config.json, so {source} builds the model: set model.hf_config_path to the "
                "config.json the checkpoint was saved with")
    chosen_file = os.path.join(chosen, "config.json") if os.path.isdir(chosen) else chosen
    if os.path.realpath(chosen_file) != os.path.realpath(own):
        return (f"; the model comes from model.hf_config_path {chosen}, not from the checkpoint's own {own}: leave "
                "model.hf_config_path empty to build the checkpoint's model")
    return ""


def _check_checkpoints(cfg: JobConfig, spec: ModelSpec, model_args) -> str | None:
    """Fail before launch on a checkpoint that cannot be resumed or loaded (metadata, file sizes, weight names and
    shapes only): unreadable, truncated, or weights the model and the checkpoint do not share by name or shape
    (unless `checkpoint.allow_partial_load`). Returns the note of an allowed partial load."""
    ckpt = cfg.checkpoint
    try:
        resume = latest_checkpoint(ckpt, cfg.job.dump_folder)
        if resume is None and not ckpt.initial_load_path:
            return None
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in spec.model_cls(model_args).state_dict().items()}
        if resume is not None:
            mismatch = check_checkpoint(resume, shapes)
        elif ckpt.initial_load_in_hf:
            missing, extra, reshaped = spec.checkpoints.hf.compare_checkpoint(ckpt.initial_load_path, model_args)
            mismatch = WeightMismatch(ckpt.initial_load_path, list(missing), list(missing.values()), extra, reshaped)
        else:
            mismatch = check_checkpoint(ckpt.initial_load_path, shapes, model_only=True)
    except (CheckpointError, ValueError) as e:
        raise ConfigError("checkpoint", str(e))
    problem = mismatch.problem(spec.checkpoints.optional_weights, ckpt.allow_partial_load, resume=resume is not None)
    if problem is not None:
        hint = _hf_config_hint(cfg) if resume is None and ckpt.initial_load_in_hf else ""
        raise ConfigError("checkpoint", problem + hint)
    return mismatch.note()


def _check_resumed_position(cfg: JobConfig, loader: GlobalOrderLoader) -> None:
    """Fail before launch when the pre-tokenized data cannot hold the resumed checkpoint's data position: it was saved
    from other documents or another tokenizer (the check loads the position into a copy of the loader)."""
    if not isinstance(loader, PretokenizedLoader):
        return
    try:
        resume = latest_checkpoint(cfg.checkpoint, cfg.job.dump_folder)
    except CheckpointError:
        return  # `_check_checkpoints` reports it
    state = saved_loader_state(resume) if resume is not None else None
    if state is None:
        return
    try:
        copy.copy(loader).load_state_dict(state)
    except ValueError as e:
        raise ConfigError("dataset.pretokenized", f"resuming {resume}: {e}", "the pre-tokenized folder of the "
                          "documents and tokenizer the checkpoint trained on")


def warn_settings_without_effect(prep: Prepared, device: torch.device) -> None:
    """Log once what the config asks for that this run's device, dtype or layout makes a no-op."""
    cfg = prep.cfg
    warning = save_ops_warning(cfg.activation_checkpoint, device.type, cfg.training.dtype, prep.dims.ep,
                               cfg.parallelism.expert_parallel_comm_backend)
    if warning is not None:
        logger.warning(warning)
