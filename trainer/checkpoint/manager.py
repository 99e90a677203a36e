"""CheckpointManager: resume from the latest intact checkpoint, save every `interval` steps (synchronously or in the
background), on preemption, or model-only at the last step; publish atomically and keep the newest `keep_latest_k`."""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.files import (PREEMPTED_MARKER, CheckpointError, checkpoint_damage, latest_checkpoint,
                                      list_checkpoints)
from trainer.checkpoint.states import ModelState, ObjectState, OnlySaved, OptimizerState, TrainState
from trainer.checkpoint.weights import check_checkpoint
from trainer.lr_schedule import WarmupDecayLR

logger = logging.getLogger("trainer")


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, a lost mount); its partial folder is removed, the previous
    checkpoint stays the latest. One-line message naming the path and the error."""


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
            if self.rank == 0 and (note := self.states["optimizer"].conversion_note(path)):
                logger.info(note)
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
                model = OnlySaved(self.model, check_checkpoint(self.cfg.initial_load_path, shapes,
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
