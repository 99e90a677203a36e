"""CheckpointManager: resume from the latest intact checkpoint, save every `interval` steps (synchronously or in the
background), on preemption, or model-only at the last step; publish atomically and keep the newest `keep_latest_k`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.files import (PREEMPTED_MARKER, CheckpointError, checkpoint_damage, checksum_damage,
                                      list_checkpoints, resume_candidates, skipped_line, write_checksums)
from trainer.checkpoint.space import (folder_bytes, free_bytes, full_disk_line, no_space_errno, size_text,
                                      state_bytes)
from trainer.checkpoint.states import ModelState, ObjectState, OnlySaved, OptimizerState, TrainState
from trainer.checkpoint.weights import check_checkpoint
from trainer.lr_schedule import WarmupDecayLR

logger = logging.getLogger("trainer")


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, a lost mount); its partial folder is removed, the previous
    checkpoint stays the latest. One-line message naming the path and the error."""


class _FileError(RuntimeError):
    """A checkpoint file that could not be read, with its name (DCP's own errors do not say which file)."""


class _NamingReader(dcp.FileSystemReader):
    """DCP's file-system reader, reading one file at a time so that a failure names the file it is in."""

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                first = " ".join(str(e).split()).split(". ")[0]  # torch's zip reader adds advice after its cause
                raise _FileError(f"{name}: {type(e).__name__}: {first}") from None
        future = torch.futures.Future()
        future.set_result(None)
        return future


def saved_loader_state(path: str) -> dict | None:
    """The data loader's state in the checkpoint at `path`, read alone in this process (before any process group
    exists); None if the checkpoint holds none that can be read."""
    blob = {"dataloader": {"0": b""}}  # ObjectState's layout: one pickled state per object
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(blob, checkpoint_id=path, no_dist=True)
        return pickle.loads(blob["dataloader"]["0"])
    except (Exception, CheckpointException):  # a damaged checkpoint: its resume falls back (CheckpointManager.load)
        return None


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
        self._needed: dict[bool, int] = {}  # bytes a full (False) or model-only (True) save writes, once measured
        self.last_published: str | None = None
        """The checkpoint this run saved last (for the run's summary)."""
        self.resumed_from: str | None = None
        """The checkpoint `load` resumed from (a damaged newer one may have been skipped), or None."""

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def load(self) -> int:
        """Resume from the latest intact (or the `load_step`) checkpoint; else load `initial_load_path` weights.
        Returns the step to continue after (0 for a fresh run). Warns when a save would not fit on the disk."""
        path = self.resumed_from = self._resume()
        if path is not None:
            logger.info("resumed from %s (step %d)", path, self.train_state.step)
            if self.rank == 0 and (note := self.states["optimizer"].conversion_note(path)):
                logger.info(note)
            changes = self.lr_schedulers[0].resume_changes  # every part's schedule has the same settings
            if changes:
                logger.info("LR schedule changed since the checkpoint (%s): the LR follows the current config "
                            "from step %d on (lr %.4g)",
                            ", ".join(f"{key} {old} -> {new}" for key, old, new in changes),
                            self.train_state.step + 1, self.lr_schedulers[0].get_last_lr()[0])
        elif self.cfg.initial_load_path and not self.cfg.initial_load_in_hf:
            model = self.model
            if self.cfg.allow_partial_load:
                shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
                model = OnlySaved(self.model, check_checkpoint(self.cfg.initial_load_path, shapes,
                                                                model_only=True).loadable(shapes))
            self._load({"model": model}, self.cfg.initial_load_path)
            logger.info("initial weights loaded from %s", self.cfg.initial_load_path)
        if self.cfg.enable:
            self._warn_if_saves_do_not_fit(resumed=path is not None)
        return self.train_state.step if path is not None else 0

    def _resume(self) -> str | None:
        """Load the newest checkpoint that every rank verifies and loads without error, and return its path (None:
        there is none). A failed load falls back to the next older checkpoint on every rank alike (they agree
        after each try), which is then loaded whole, so nothing of the failed one stays. One warning names what
        was skipped and why. A `load_step` has no fallback: its failure is a CheckpointError."""
        skipped: list[tuple[int, str]] = []
        chosen, first_problem = None, None
        for path in resume_candidates(self.cfg, self.dump_folder, skipped):
            problem = self._try_resume(path)
            if problem is None:
                chosen = path
                break
            if self.cfg.load_step != -1:
                raise CheckpointError(f"cannot load checkpoint {path}: {problem}")
            first_problem = first_problem or f"checkpoint {path} {problem}"
            name = os.path.basename(path)
            skipped.append((int(name.removeprefix("step-")), f"{name} ({problem})"))
        if chosen is None and first_problem is not None:
            raise CheckpointError(f"{first_problem}, and no older checkpoint in {self.folder} is intact")
        line = skipped_line(skipped, self.folder, chosen)
        if line is not None and self.rank == 0:
            logger.warning(line)
        return chosen

    def _try_resume(self, path: str) -> str | None:
        """Verify (with `verify = "checksum"`) and load the checkpoint at `path` on every rank: None if every rank
        succeeded, else why it cannot be used, the same on every rank."""
        if self.cfg.verify == "checksum":
            world = dist.get_world_size() if dist.is_initialized() else 1
            damage = checksum_damage(path, self.rank, world)
            problem = self._agreed(f"rank {self.rank}: {damage}" if damage is not None else None)
            if problem is not None:
                return problem
        try:
            dcp.load(self.states, checkpoint_id=path, storage_reader=_NamingReader(path))
            problem = None
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            problem = f"cannot be loaded: {_first_failure(e, self.rank)[:300]}"
        return self._agreed(problem)

    def _agreed(self, problem: str | None) -> str | None:
        """The problem of the lowest rank that has one, on every rank (a collective: every rank must call it)."""
        if not dist.is_initialized():
            return problem
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p is not None), None)

    def _warn_if_saves_do_not_fit(self, resumed: bool) -> None:
        """At start: warn (rank 0) when the checkpoint folder's disk cannot hold a save. A resumed run knows the
        size of its saves; a fresh one has no optimizer state yet (it appears at the first step), so only its
        weights are counted, a lower bound."""
        known = resumed and all(opt.state for opt in self.states["optimizer"].optimizers)
        needed = self._save_bytes(self.states) if known else self._total_bytes(state_bytes({"model": self.model}))
        free = free_bytes(self.folder)
        if self.rank == 0 and free < needed:
            what = ("a checkpoint of this run needs" if known else
                    "a checkpoint needs more than the model's weights alone,")
            logger.warning("checkpoint: %s has %s free; %s %s: the saves will fail (free space, or set "
                           "job.dump_folder or checkpoint.folder to a larger disk)", self.folder, size_text(free),
                           what, size_text(needed))

    def _total_bytes(self, sizes: dict[str, int]) -> int:
        """The bytes of a checkpoint from every rank's `state_bytes` (a collective): each key counted once."""
        if dist.is_initialized():
            gathered: list[dict[str, int] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sizes)
            sizes = {key: size for rank_sizes in gathered for key, size in rank_sizes.items()}
        return sum(sizes.values())

    def _save_bytes(self, states: dict, model_only: bool = False) -> int:
        """The bytes a save of `states` writes (measured at the first save of its kind; the shapes do not change)."""
        if model_only not in self._needed:
            self._needed[model_only] = self._total_bytes(state_bytes(states))
        return self._needed[model_only]

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
        states, model_only = self.states, last and self.cfg.last_save_model_only
        if model_only:
            dtype = torch.bfloat16 if self.cfg.export_dtype == "bfloat16" else torch.float32
            states = {"model": {k: v.to(dtype) for k, v in self.model.state_dict().items()}}
        self._save(step, states, background=self.cfg.async_mode == "async" and not last, model_only=model_only)

    def save_now(self, step: int, marker: dict | None = None) -> str:
        """A synchronous save of the full state at `step` into the checkpoint folder, whether `enable` is on or not
        (a preemption); `marker` is written beside the shards as PREEMPTED. Returns the published folder."""
        return self._save(step, self.states, background=False, marker=marker)

    def _save(self, step: int, states: dict, background: bool, marker: dict | None = None,
              model_only: bool = False) -> str:
        self.train_state.step = step
        self.finish()
        final = os.path.join(self.folder, f"step-{step}")
        tmp = final + ".tmp"
        needed = self._save_bytes(states, model_only)

        def prepare_folder():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(self.folder, exist_ok=True)
            free = free_bytes(self.folder)
            if free < needed:  # the save would fail part-way: say so before writing anything
                raise _NoSpace(full_disk_line(self.folder, free, needed))

        self._on_rank_0(prepare_folder, tmp, needed)
        try:
            if background:
                self._pending = (dcp.async_save(states, checkpoint_id=tmp), tmp, final, needed)
                return final
            dcp.save(states, checkpoint_id=tmp)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            self._abandon(tmp, (_first_failure(e), no_space_errno(e)), needed)
        self._publish(tmp, final, needed, marker)
        return final

    def finish(self) -> None:
        """Wait for a pending async save and publish it (called before the next save and at the end)."""
        if self._pending is None:
            return
        future, tmp, final, needed = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            self._abandon(tmp, (_first_failure(e), no_space_errno(e)), needed)
        self._publish(tmp, final, needed)

    def _abandon(self, tmp: str, failure: tuple[str, bool | None], needed: int) -> None:
        """A save failed (on this rank or, as DCP reports to every rank, on another): remove its partial folder,
        which resume never picks anyway, and end the run with one line, the same on every rank (rank 0 words it);
        the previous checkpoint stays the latest. `failure`: (the first failing rank's error, whether it was
        ENOSPC or EDQUOT, or None when the error already says why). A disk too full for the rest of the save is
        named as such, with the bytes free and needed: torch's writer reports it as `unexpected pos ...`."""
        line = None
        if self.rank == 0:
            error, no_space = failure
            if no_space is not None:
                error = self._disk_words(error, no_space, tmp, needed)
            line = (f"saving {tmp} failed: {error}; the previous checkpoint stays the latest "
                    f"({_latest_name(self.folder)})")
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized():
            shared = [line]
            dist.broadcast_object_list(shared, src=0)
            line = shared[0]
        raise CheckpointSaveError(line) from None

    def _disk_words(self, error: str, no_space: bool, tmp: str, needed: int) -> str:
        """`error` said in words when the disk is the cause: too little space left for the rest of the save (the
        folder, the bytes free and needed), or ENOSPC/EDQUOT with space left (inodes, a quota)."""
        free = free_bytes(self.folder)
        if free < needed - folder_bytes(tmp):
            return f"{full_disk_line(self.folder, free, needed)} ({error})"
        if no_space:
            return (f"{error} ({self.folder} has {size_text(free)} free by the file system's count and a checkpoint "
                    f"needs about {size_text(needed)}: out of inodes, or over a quota?)")
        return error

    def _on_rank_0(self, work, tmp: str, needed: int) -> None:
        """Run `work` (file operations of a save) on rank 0, and tell every rank whether it failed: an OSError (a
        full disk, a lost mount, no permission) ends the save on every rank as a failed DCP save does."""
        failure = None
        if self.rank == 0:
            try:
                work()
            except _NoSpace as e:
                failure = (str(e), None)
            except OSError as e:
                failure = (f"rank 0: {type(e).__name__}: {' '.join(str(e).split())}", no_space_errno(e))
        if dist.is_initialized():
            shared = [failure]
            dist.broadcast_object_list(shared, src=0)  # also the barrier the save needs here
            failure = shared[0]
        if failure is not None:
            self._abandon(tmp, failure, needed)

    def _publish(self, tmp: str, final: str, needed: int, marker: dict | None = None) -> None:
        if self.cfg.verify == "checksum":
            failure = None
            try:
                write_checksums(tmp, self.rank)
            except OSError as e:
                failure = (f"rank {self.rank}: {type(e).__name__}: {' '.join(str(e).split())}", no_space_errno(e))
            failure = self._agreed(failure)  # also the barrier: every rank's files are written
            if failure is not None:
                self._abandon(tmp, failure, needed)
        else:
            self._barrier()  # every rank's files are written

        def publish():
            if marker is not None:
                with open(os.path.join(tmp, PREEMPTED_MARKER), "w") as f:
                    json.dump(marker, f)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)  # atomic: a resume sees the whole checkpoint or none of it
            self._purge(final)

        self._on_rank_0(publish, tmp, needed)
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


class _NoSpace(Exception):
    """Rank 0 found too little free space for a save before writing it; its message is the one-line reason."""


def _first_failure(error: BaseException, rank: int | None = None) -> str:
    """One line for a save or load error: DCP's CheckpointException holds every failed rank's exception
    (multi-line); another error is named with `rank`, the rank that raised it, when given."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank]
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, _FileError):  # names the file: its own message is the cause
            return f"rank {rank}: {' '.join(str(cause).split())}"
        return f"rank {rank}: {type(cause).__name__}: {' '.join(str(cause).split())}"
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(error).__name__}: {' '.join(str(error).split())}"


def _latest_name(folder: str) -> str:
    steps = list_checkpoints(folder)
    return f"step-{steps[-1]}" if steps else "none yet"
