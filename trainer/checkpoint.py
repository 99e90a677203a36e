"""Distributed checkpoints (torch.distributed.checkpoint): save, resume, reshard, model-only export.

Layout: `<dump_folder>/<checkpoint.folder>/step-<N>/` holds one DCP checkpoint with
    model        every model part's state dict, under the full model's parameter names (expert bias included)
    optimizer    every part's AdamW state, flattened and keyed by parameter name (so any layout can load it)
    lr_scheduler (the schedule's position; on resume the LR comes from the current config: a run extended to more
                 steps follows its new schedule), dataloader (global stream position), train_state (step, RNG)
Names do not depend on the parallel layout, so a checkpoint saved at (fsdp=2, ep=2) loads at fsdp=4, on one
process, or split into pipeline stages: DCP reshards.

Atomicity: a checkpoint is written to `step-<N>.tmp` and renamed to `step-<N>` by rank 0 after every rank has
finished writing. Resume only considers `step-<N>` folders with DCP metadata, so a crash mid-save (even a killed
rank) leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from core.config import ConfigError, option
from trainer.lr_schedule import WarmupDecayLR
from trainer.preemption import DEFAULT_SIGNALS, parse_signals


@dataclass
class CheckpointSection:
    """Saving and loading distributed checkpoints."""

    enable: bool = False
    """Save checkpoints and resume from the latest one found in folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = option(500, ge=1)
    """Save every this many steps."""
    keep_latest_k: int = option(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: str = option("disabled", choices=["disabled", "async"])
    """disabled saves synchronously; async writes in the background while training continues."""
    load_step: int = option(-1, ge=0, special=-1)
    """Step to resume from; -1 = the latest checkpoint in folder."""
    last_save_model_only: bool = False
    """Save only model weights (no optimizer or data state) at the last step, for export."""
    export_dtype: str = option("float32", choices=["float32", "bfloat16"])
    """Dtype of the weights in a model-only last save."""
    initial_load_path: str = ""
    """Checkpoint to initialise the model from when folder holds no checkpoint yet."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors checkpoint rather than a native one."""
    allow_partial_load: bool = False
    """Load a checkpoint whose weights differ from the model's: weights the model does not have are skipped, and
    (initial_load_path only) weights the checkpoint lacks keep their initialisation; a warning names both. Off,
    either is an error before launch."""

    preemption_signals: list[str] = option(list(DEFAULT_SIGNALS))
    """Signals that end the run with a checkpoint of its last finished step, saved even when enable is false (see
    trainer/preemption.py); empty: none (the signals keep their default action)."""

    def check(self) -> list[ConfigError]:
        """Settings of this section that contradict each other, and unknown signal names."""
        if self.initial_load_in_hf and not self.initial_load_path:
            return [ConfigError("initial_load_in_hf", "true but checkpoint.initial_load_path is empty",
                                "a path to load from")]
        try:
            parse_signals(self.preemption_signals)
        except ValueError as e:
            return [ConfigError("preemption_signals", str(e), "signal names such as TERM, USR1, USR2, or empty")]
        return []


logger = logging.getLogger("trainer")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_STEP_OR_TMP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")  # a published checkpoint, or a save still being written


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, corrupt, from another model); one-line message."""


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, a lost mount); its partial folder is removed, the previous
    checkpoint stays the latest. One-line message naming the path and the error."""


PREEMPTED_MARKER = "PREEMPTED"
"""File in a checkpoint saved on a preemption signal: a run with checkpoint.enable = false resumes from those."""


class ModelState(Stateful):
    """All model parts as one state dict with the full model's names."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self):
        merged = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict):
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class _OnlySaved(Stateful):
    """A partial load's view of the model state: only the weights the checkpoint holds in the model's shapes are
    asked for (DCP refuses to load a key it lacks or a tensor of another shape); the others keep their
    initialisation."""

    def __init__(self, model: ModelState, saved: set[str]):
        self.model, self.saved = model, saved

    def state_dict(self):
        return {k: v for k, v in self.model.state_dict().items() if k in self.saved}

    def load_state_dict(self, state_dict):
        self.model.load_state_dict(state_dict)


class OptimizerState(Stateful):
    """One optimizer per model part, flattened to parameter-name keys and merged."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        merged = {}
        for part, opt in zip(self.parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=self.options))
        return merged

    def load_state_dict(self, state_dict):
        for part, opt in zip(self.parts, self.optimizers):
            # The LR belongs to the LR schedule, which recomputes it from the current config on resume; the saved
            # one is the old schedule's (DCP loads the schedule first: keys load in sorted order).
            lrs = [group["lr"] for group in opt.param_groups]
            set_optimizer_state_dict(part, opt, state_dict, options=self.options)
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr


class ObjectState(Stateful):
    """Objects with state_dict/load_state_dict (LR schedulers, the data loader), replicated on every rank.

    Their states are stored as one opaque pickled blob each: DCP loads nested lists element-wise into the
    *current* structure, so a list whose length changed since construction (the loader's token carry-over)
    would silently come back empty.
    """

    def __init__(self, *objects):
        self.objects = objects

    def state_dict(self):
        return {str(i): pickle.dumps(obj.state_dict()) for i, obj in enumerate(self.objects)}

    def load_state_dict(self, state_dict):
        for i, obj in enumerate(self.objects):
            obj.load_state_dict(pickle.loads(state_dict[str(i)]))


class TrainState(Stateful):
    """The step counter and the CPU RNG state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])


def list_checkpoints(folder: str) -> list[int]:
    """Steps of the complete checkpoints in `folder`, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


class CheckpointManager:
    """Saves every `interval` steps and at the last step, resumes from the latest complete checkpoint.

    `cfg` is the `[checkpoint]` section. Everything else is the state to save; the manager never reaches into
    the rest of the job config.
    """

    def __init__(self, cfg, dump_folder: str, model_parts, optimizers, lr_schedulers: list[WarmupDecayLR],
                 dataloader):
        self.cfg = cfg
        self.lr_schedulers = lr_schedulers
        self.dump_folder = dump_folder
        self.folder = os.path.join(dump_folder, cfg.folder)
        self.model = ModelState(model_parts)
        self.train_state = TrainState()
        self.states = {
            "model": self.model,
            "optimizer": OptimizerState(model_parts, optimizers),
            "lr_scheduler": ObjectState(*lr_schedulers),
            "dataloader": ObjectState(dataloader),
            "train_state": self.train_state,
        }
        self._pending = None  # (future, tmp_dir, final_dir) of an async save
        self.last_published: str | None = None
        """The checkpoint this run saved last (for the run's summary)."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def load(self) -> int:
        """Resume from the latest (or `load_step`) checkpoint; else load `initial_load_path` weights. Returns the
        step to continue after (0 for a fresh run)."""
        path = latest_checkpoint(self.cfg, self.dump_folder, report_skipped=self.rank == 0)
        if path is not None:
            self._load(self.states, path)
            logger.info("resumed from %s (step %d)", path, self.train_state.step)
            changes = self.lr_schedulers[0].resume_changes  # every part's schedule has the same settings
            if changes:
                logger.info("LR schedule changed since the checkpoint (%s): the LR follows the current config "
                            "from step %d on (lr %.4g)",
                            ", ".join(f"{key} {old} -> {new}" for key, old, new in changes),
                            self.train_state.step + 1, self.lr_schedulers[0].get_last_lr()[0])
            return self.train_state.step
        if self.cfg.initial_load_path and not self.cfg.initial_load_in_hf:
            model = self.model
            if self.cfg.allow_partial_load:
                shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
                model = _OnlySaved(self.model, check_checkpoint(self.cfg.initial_load_path, shapes,
                                                                model_only=True).loadable(shapes))
            self._load({"model": model}, self.cfg.initial_load_path)
            logger.info("initial weights loaded from %s", self.cfg.initial_load_path)
        return 0

    @staticmethod
    def _load(states: dict, path: str) -> None:
        try:
            dcp.load(states, checkpoint_id=path)
        except Exception as e:  # DCP raises many kinds; the user needs the path and the first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"cannot load checkpoint {path}: {first[:300]}") from None

    def due(self, step: int, last: bool) -> bool:
        """Whether `maybe_save` saves at `step`."""
        return self.cfg.enable and (last or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, last: bool) -> None:
        """Save at every `interval` steps and at the last step (model only if `last_save_model_only`)."""
        if not self.due(step, last):
            return
        states = self.states
        if last and self.cfg.last_save_model_only:
            dtype = torch.bfloat16 if self.cfg.export_dtype == "bfloat16" else torch.float32
            states = {"model": {k: v.to(dtype) for k, v in self.model.state_dict().items()}}
        self._save(step, states, background=self.cfg.async_mode == "async" and not last)

    def save_now(self, step: int, marker: dict | None = None) -> str:
        """A synchronous save of the full state at `step` into the checkpoint folder, whether `enable` is on or not
        (a preemption); `marker` is written beside the shards as PREEMPTED. Returns the published folder."""
        return self._save(step, self.states, background=False, marker=marker)

    def _save(self, step: int, states: dict, background: bool, marker: dict | None = None) -> str:
        self.train_state.step = step
        self.finish()
        final = os.path.join(self.folder, f"step-{step}")
        tmp = final + ".tmp"

        def prepare_folder():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(self.folder, exist_ok=True)

        self._on_rank_0(prepare_folder, tmp)
        try:
            if background:
                self._pending = (dcp.async_save(states, checkpoint_id=tmp), tmp, final)
                return final
            dcp.save(states, checkpoint_id=tmp)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            self._abandon(tmp, _first_failure(e))
        self._publish(tmp, final, marker)
        return final

    def finish(self) -> None:
        """Wait for a pending async save and publish it (called before the next save and at the end)."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            self._abandon(tmp, _first_failure(e))
        self._publish(tmp, final)

    def _abandon(self, tmp: str, failure: str) -> None:
        """A save failed (on this rank or, as DCP reports to every rank, on another): remove its partial folder,
        which resume never picks anyway, and end the run with one line; the previous checkpoint stays the latest."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(f"saving {tmp} failed: {failure}; the previous checkpoint stays the latest "
                                  f"({_latest_name(self.folder)})") from None

    def _on_rank_0(self, work, tmp: str) -> None:
        """Run `work` (file operations of a save) on rank 0, and tell every rank whether it failed: an OSError (a
        full disk, a lost mount, no permission) ends the save on every rank as a failed DCP save does."""
        failure = None
        if self.rank == 0:
            try:
                work()
            except OSError as e:
                failure = f"rank 0: {type(e).__name__}: {' '.join(str(e).split())}"
        if dist.is_initialized():
            shared = [failure]
            dist.broadcast_object_list(shared, src=0)  # also the barrier the save needs here
            failure = shared[0]
        if failure is not None:
            self._abandon(tmp, failure)

    def _publish(self, tmp: str, final: str, marker: dict | None = None) -> None:
        self._barrier()  # every rank's files are written

        def publish():
            if marker is not None:
                with open(os.path.join(tmp, PREEMPTED_MARKER), "w") as f:
                    json.dump(marker, f)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)  # atomic: a resume sees the whole checkpoint or none of it
            self._purge(final)

        self._on_rank_0(publish, tmp)
        if self.rank == 0:
            logger.info("checkpoint saved: %s", final)
        self.last_published = final

    def _purge(self, published: str) -> None:
        """Keep the newest `keep_latest_k` intact checkpoints up to the one just `published` (which counts as one):
        older ones go, damaged ones included; damaged ones newer than it stay (a resume skipped them, and this run
        replaces them when it saves their step). Runs only after a checkpoint was published, so the newest intact
        one is never removed before its successor exists."""
        k = self.cfg.keep_latest_k
        if k == 0:
            return
        newest = int(os.path.basename(published).removeprefix("step-"))
        kept = 1
        for step in reversed([s for s in list_checkpoints(self.folder) if s < newest]):
            path = os.path.join(self.folder, f"step-{step}")
            if kept < k and checkpoint_damage(path) is None:
                kept += 1
            else:
                shutil.rmtree(path, ignore_errors=True)


def _first_failure(error: Exception) -> str:
    """One line for a save error: DCP's CheckpointException holds every failed rank's exception (multi-line)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank]
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"rank {rank}: {type(cause).__name__}: {' '.join(str(cause).split())}"
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _latest_name(folder: str) -> str:
    steps = list_checkpoints(folder)
    return f"step-{steps[-1]}" if steps else "none yet"


def key_groups(keys: list[str], limit: int = 4) -> str:
    """Keys summarised by module, cut after their first numeric component: `layers.4.*, layers.5.* (36 weights)`."""
    groups: dict[str, None] = {}
    for key in keys:
        parts = key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        groups[key if cut is None or cut == len(parts) - 1 else ".".join(parts[:cut + 1]) + ".*"] = None
    names = list(groups)
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return f"{shown} ({len(keys)} weight{'s' if len(keys) != 1 else ''})"


def key_names(keys: list[str], limit: int = 3) -> str:
    """The first `limit` keys in full, then a count: `a, b, c and 17 more (20 weights)`."""
    shown = ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
    return f"{shown} ({len(keys)} weight{'s' if len(keys) != 1 else ''})"


_RESUME_NEEDS_ALL = ("; a resume needs every weight: start a new run from it with checkpoint.initial_load_path and "
                     "checkpoint.allow_partial_load = true")


@dataclass
class WeightMismatch:
    """The weights a checkpoint and a model do not share (names as the checkpoint spells them).

    missing: the model expects them, the checkpoint lacks them; `missing_ours` has them under the model's
        state_dict keys (for the hint of `optional_weights`). extra: the checkpoint holds them, the model has no
        place for them. reshaped: both have them, in other shapes (another flavor's experts): name -> (the
        checkpoint's shape, the model's).
    """

    path: str
    missing: list[str]
    missing_ours: list[str]
    extra: list[str]
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    def problem(self, optional_weights: dict[str, str], allow_partial: bool, resume: bool) -> str | None:
        """The one-line reason the checkpoint cannot be loaded, or None. A resume needs every weight of the model
        as the model has it; an initial load with `allow_partial` takes what matches."""
        if self.missing and (resume or not allow_partial):
            line = f"checkpoint {self.path} lacks {key_groups(self.missing)} that the model expects"
            switches = {switch for prefix, switch in optional_weights.items()
                        if all(k.startswith(prefix) for k in self.missing_ours)}
            if switches:
                line += f"; train without them: {' '.join(sorted(switches))}"
            elif resume:
                line += _RESUME_NEEDS_ALL
            else:
                line += "; checkpoint.allow_partial_load = true keeps their initialisation"
            return line
        if self.reshaped and (resume or not allow_partial):
            name, (saved, wanted) = next(iter(self.reshaped.items()))
            line = (f"checkpoint {self.path} holds {key_names(list(self.reshaped))} in other shapes than the model's "
                    f"({name}: {list(saved)} saved, {list(wanted)} in the model): saved from another flavor or "
                    "other model settings?")
            return line + (_RESUME_NEEDS_ALL if resume else
                           "; checkpoint.allow_partial_load = true loads the weights that match and skips these")
        if self.extra and not allow_partial:
            return (f"checkpoint {self.path} holds {key_groups(self.extra)} that the model does not have (a deeper "
                    "model, another flavor, or a part this run leaves out?); checkpoint.allow_partial_load = true "
                    "loads the rest")
        return None

    def note(self) -> str | None:
        """The warning of a partial load: what is skipped and what keeps its initialisation; None if nothing."""
        parts = []
        if self.extra:
            parts.append(f"skipped {key_groups(self.extra)} the model does not have")
        if self.reshaped:
            parts.append(f"skipped {key_names(list(self.reshaped))} in other shapes than the model's (they keep "
                         "their initialisation)")
        if self.missing:
            parts.append(f"{key_groups(self.missing)} the checkpoint lacks keep their initialisation")
        return f"partial load of {self.path}: " + "; ".join(parts) if parts else None

    def loadable(self, expected_shapes: dict[str, tuple[int, ...]]) -> set[str]:
        """The model's keys a partial load reads: in the checkpoint, in the model's shape (native checkpoints,
        whose names are the model's)."""
        return set(expected_shapes) - set(self.missing) - set(self.reshaped)


def check_checkpoint(path: str, expected_shapes: dict[str, tuple[int, ...]],
                     model_only: bool = False) -> WeightMismatch:
    """Raise CheckpointError unless `path` is a complete, readable DCP checkpoint (with optimizer state unless
    `model_only`); return the weights it and a model of `expected_shapes` do not share by name or by shape (the
    caller decides).

    Reads only metadata and file sizes, so the trainer can run it before any process group exists: a corrupt or
    truncated checkpoint, or one from another flavor, is reported as one line before anything starts.
    """
    damage = checkpoint_damage(path)
    if damage is not None:
        raise CheckpointError(damage)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weights = {key[len("model."):]: entry for key, entry in saved.items() if key.startswith("model.")}
    if not model_only and not any(key.startswith("optimizer.") for key in saved):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (a model-only export cannot be resumed)")
    reshaped = {}
    for fqn, shape in expected_shapes.items():
        entry = weights.get(fqn)
        if entry is not None and tuple(getattr(entry, "size", ())) != tuple(shape):
            reshaped[fqn] = (tuple(entry.size), tuple(shape))
    missing = [fqn for fqn in expected_shapes if fqn not in weights]
    return WeightMismatch(path, missing, missing, [fqn for fqn in weights if fqn not in expected_shapes], reshaped)


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be read (missing, unreadable metadata, a shard missing or cut short), or
    None; reads the metadata and file sizes only."""
    if not os.path.isdir(path):
        return f"checkpoint {path} does not exist"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"checkpoint {path} is unreadable or incomplete ({type(e).__name__})"
    for item in metadata.storage_data.values():
        file = os.path.join(path, item.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < item.offset + item.length:
            return f"checkpoint {path} is truncated: {item.relative_path} is missing or too short"
    return None


def _incomplete_checkpoints(folder: str) -> list[tuple[int, str, str]]:
    """(step, folder name, why) of every `step-<N>` folder in `folder` that resume will not use."""
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        match = _STEP_OR_TMP_DIR.match(name)
        if match is None:
            continue
        if match.group(2):
            found.append((int(match.group(1)), name, "an unfinished save"))
        elif not os.path.isfile(os.path.join(folder, name, ".metadata")):
            found.append((int(match.group(1)), name, "no .metadata"))
    return sorted(found)


def latest_checkpoint(cfg, dump_folder: str, report_skipped: bool = False) -> str | None:
    """Path of the checkpoint a run with `[checkpoint]` section `cfg` would resume from, if any.

    With `load_step = -1` the newest intact checkpoint: folders that are incomplete (no DCP `.metadata`, or a `.tmp`
    save) or damaged (unreadable metadata, a shard missing or cut short: a full disk, a failing node) are skipped, so
    an unattended restart never stops on them; with `report_skipped` a warning names them (pass it in one process
    of a run only: preflight and the other ranks run the same search). When every checkpoint is damaged,
    CheckpointError: starting over would silently discard the run. A `load_step` is taken as it is (a damaged
    one is then refused by `check_checkpoint`). With `enable = false` only a checkpoint saved on a preemption
    signal counts (trainer/preemption.py): the same command continues after a requeue.
    """
    folder = os.path.join(dump_folder, cfg.folder)
    steps = list_checkpoints(folder)
    if not cfg.enable:
        steps = [step for step in steps if os.path.isfile(os.path.join(folder, f"step-{step}", PREEMPTED_MARKER))]
    if cfg.load_step != -1:
        if cfg.load_step not in steps:
            raise CheckpointError(f"checkpoint.load_step {cfg.load_step} not found in {folder} (have {steps})")
        return os.path.join(folder, f"step-{cfg.load_step}")
    skipped = [(step, f"{name} ({why})") for step, name, why in _incomplete_checkpoints(folder)] if cfg.enable else []
    chosen, newest_damage = None, None
    for step in reversed(steps):
        path = os.path.join(folder, f"step-{step}")
        damage = checkpoint_damage(path)
        if damage is None:
            chosen = step
            break
        newest_damage = newest_damage or damage
        skipped.append((step, f"step-{step} ({damage.removeprefix(f'checkpoint {path} ')})"))
    if chosen is None and newest_damage is not None:
        # every checkpoint is damaged: starting over would silently throw the run's progress away
        raise CheckpointError(f"{newest_damage}, and no older checkpoint in {folder} is intact")
    skipped = [what for step, what in sorted(skipped) if chosen is None or step > chosen]
    if skipped and report_skipped:
        logger.warning("checkpoint: skipped %s in %s; %s", ", ".join(skipped), folder,
                       f"resuming from step-{chosen}" if chosen is not None else "no intact checkpoint to resume from")
    return None if chosen is None else os.path.join(folder, f"step-{chosen}")
