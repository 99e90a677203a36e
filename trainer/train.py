"""The training loop: `python -m trainer.train [--job.config_file X.toml] [--section.key value ...]`.

Order of work (nothing model-specific here; the model comes from the registry):
  1. config (TOML + CLI) and every check that can fail on user input, before any process-group work or any
     file is written (`trainer/prepare.py`): degrees vs world size, model args, tokenizer, dataset, checkpoints.
  2. process group and device; the model is built on the meta device, split and parallelized
     (`trainer/build.py`), then materialised and initialised.
  3. loop: batch -> the model's `before_step` hook (global valid tokens) -> forward -> sum-CE / global valid
     tokens -> backward (gradient accumulation) -> clip by the global norm -> AdamW step -> LR schedule -> the
     model's `post_optimizer_step` hook -> metrics and memory; validation every `validation.freq` steps.

Over 400 lines on purpose: the `Trainer` (a step, validation, preemption, the end of a run) and the entry point that
turns every known error into one line are read together, top to bottom; what can live apart does (preparation,
the model build, the run summary, memory, checkpoints, data).
"""

from __future__ import annotations

if __name__ == "__main__":
    # A rank's process: preemption signals are recorded from here on, not only once the imports below (seconds) are
    # done; `_main` narrows them to checkpoint.preemption_signals once the config is read.
    from trainer.preemption import DEFAULT_SIGNALS, listen, parse_signals

    listen(parse_signals(DEFAULT_SIGNALS))

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from core.config import ConfigError
from core.loss import ScaledLoss, count_valid_tokens
from parallelisms.activation_checkpoint.policy import force_modules_warning, user_force_modules
from parallelisms.clip import clip_grad_norm_, clip_grad_scale, global_grad_norm
from parallelisms.compile import SECONDS_PER_GRAPH, compile_loss, first_compile
from parallelisms.context_parallel import ContextParallel, own_share
from parallelisms.mesh import build_meshes
from parallelisms.moe_comm.registry import get_comm_backend
from parallelisms.pipeline import build_schedule
from trainer import device as devices
from trainer.build import build_model_parts, materialize
from trainer.checkpoint.files import CheckpointError
from trainer.checkpoint.manager import CheckpointManager, CheckpointSaveError
from trainer.compile_times import CompileTimes
from trainer.data.config import DatasetError
from trainer.data.for_job import data_errors_at
from trainer.expert_load import IMAGE_TAG, expert_load_image, rows_of
from trainer.job_config import JobConfig, load_command_config, run_name
from trainer.launch import PREEMPTED_PREFIX, launched, leave_marker, report_line, restart_line
from trainer.lr_schedule import build_lr_scheduler
from trainer.memory.leak_detector import HANDLES, MEMORY, LeakDetector, MemoryLeakError
from trainer.memory.monitor import MemoryMonitor
from trainer.memory.ranks import (FIELDS, HANDLES_TAG, WORST_RANK_TAG, CrossRankMemory, RankTable, memory_layout,
                                  memory_values, place_of)
from trainer.memory.snapshots import MemorySnapshots
from trainer.metrics import MetricLogger, init_logging, new_run_dir
from trainer.optimizer import build_optimizer, grad_scale_in_kernel
from trainer.preemption import PreemptedError, Preemption, Stop, listen, parse_signals
from trainer.prepare import Prepared, prepare, warn_settings_without_effect
from trainer.step_scalars import PendingSteps, StepRecord, read_to_host
from trainer.summary import RUN_METRICS, RunSummary, run_hparams
from trainer.watchdog import COLLECTIVE_MARGIN_S, Heartbeat, reset_process_group_timeouts, set_process_group_timeouts

logger = logging.getLogger("trainer")


_NONFINITE = "nonfinite"
"""The key of a step's non-finite flag among its pending scalars (read and removed before logging)."""
_DATA_S = "data_s"
"""The key of a step's host seconds reading its batch among `train_step`'s scalars (moved to its StepRecord)."""


class TrainingError(RuntimeError):
    """A run-time fault the user must act on (e.g. non-finite loss); reported as one line, exit code 1."""


class Trainer:
    """Owns the model parts, optimizer, data and metrics of one training run (one per process)."""

    def __init__(self, prep: Prepared, device: torch.device):
        cfg = self.cfg = prep.cfg
        self.dims, self.spec, self.device = prep.dims, prep.spec, device
        self.train_loader, self.val_loader = prep.train_loader, prep.val_loader
        # every validation starts from here and reads the same batches: losses comparable across steps, and a resumed
        # run's equal to a straight run's without the validation loader's position in the checkpoint
        self._val_start = self.val_loader.state_dict() if self.val_loader is not None else None
        self.rank = devices.rank()
        self.meshes = build_meshes(self.dims, device.type) if dist.is_initialized() else None
        self.dp_group = self.meshes.group("dp") if self.meshes is not None else None
        self.pp_group = self.meshes.group("pp") if self.meshes is not None else None

        torch.manual_seed(cfg.training.seed)
        # set both ways: a process-wide switch, which an earlier job of the process may have turned on
        torch.use_deterministic_algorithms(cfg.training.deterministic)

        self.model_args = prep.model_args
        # with context parallelism the model and the loss get whole sequences and keep this rank's share
        self.context_parallel = ContextParallel.of_meshes(self.meshes)
        loss_args = (prep.model_args,) if self.context_parallel is None else (prep.model_args, self.context_parallel)
        self.loss_fn = compile_loss(self.spec.build_loss_fn(*loss_args), cfg.compile)
        built = build_model_parts(self.spec, prep.model_args, cfg, self.dims, self.meshes)
        self.model_parts = built.parts
        self.pipeline, self.schedule, self.has_first_stage, self.has_last_stage = None, None, True, True
        if self.dims.pp_enabled:
            n_microbatches = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
            # the schedule runs backward on each microbatch's loss itself: it gets the loss already scaled
            self.pp_loss = ScaledLoss(self.loss_fn)
            self.pipeline = build_schedule(built.parts, built.stage_plan, self.dims, self.meshes, cfg.parallelism,
                                           n_microbatches, self.pp_loss, device)
            self.schedule = self.pipeline.schedule
            self.has_first_stage, self.has_last_stage = self.pipeline.has_first_stage, self.pipeline.has_last_stage
        materialize(self.model_parts, device, cfg.training.seed)

        if cfg.checkpoint.initial_load_in_hf:
            self._load_hf_weights(cfg.checkpoint.initial_load_path)
        # one optimizer per model part: checkpoints key optimizer state by parameter name, whatever the layout
        self.optimizers = [build_optimizer([part], cfg.optimizer, cfg.training.seed) for part in self.model_parts]
        self.lr_schedulers = [build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
                              for opt in self.optimizers]
        # torch's flag for an optimizer that takes `found_inf` (fused AdamW): a non-finite step is skipped on the device
        self._skips_on_device = all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self.optimizers)
        # clipping by the optimizers' own division of the gradients saves a pass over them (parallelisms/clip.py)
        self._clip_in_step = (cfg.training.max_norm > 0 and self._skips_on_device
                              and all(grad_scale_in_kernel(opt) for opt in self.optimizers))
        if not self._skips_on_device and self.rank == 0:
            logger.info("optimizer.implementation = %s: skipping a non-finite step makes the host wait for each "
                        "step's loss and gradient norm (torch's foreach and for-loop AdamW take no device-side "
                        "flag; fused does)", cfg.optimizer.implementation)
        self.total_params, self.active_params, self.flops_per_token = self.spec.param_and_flop_counts(
            prep.model_args, cfg.training.seq_len)
        # FSDP casts parameters itself (MixedPrecisionPolicy); without FSDP, bf16 compute comes from autocast
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                         if cfg.training.dtype == "bfloat16" and not self.dims.sharded else contextlib.nullcontext())

        self.memory = MemoryMonitor(device, cfg.memory.track, compiled=cfg.compile.enable)
        self.memory.track(*self.model_parts, *self.optimizers)
        self.snapshots = MemorySnapshots(self.memory, os.path.join(cfg.job.dump_folder, "memory_snapshots"),
                                         cfg.memory.snapshot_freq, cfg.memory.dump_on_leak, self.rank)
        world, pp, ep = self.dims.world_size, self.dims.pp, self.dims.ep
        self.cross_rank = CrossRankMemory(dist.group.WORLD if dist.is_initialized() else None, self.rank, world, pp,
                                          ep)
        self.device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        where = place_of(self.rank, world, pp, ep) if world > 1 else ""
        self.leak_detector = LeakDetector.from_config(cfg.memory, on_leak=self.snapshots.on_leak, where=where)
        self.handle_detector = LeakDetector.for_handles(cfg.memory, where=where)
        # the comm backend's own scalars; its live handles (where it counts them) are gathered across ranks
        self.comm_backend = get_comm_backend(cfg.parallelism.expert_parallel_comm_backend) \
            if self.dims.ep_enabled else None
        counts_handles = self.comm_backend is not None and HANDLES_TAG in self.comm_backend.metrics()
        # what close() releases; set as each opens, so that a failure below closes what was opened already
        self.metrics = self.checkpoint = self.preemption = self.heartbeat = self._flag_group = None
        try:
            self.tb_run_dir = self._new_tensorboard_run() if cfg.metrics.enable_tensorboard else None
            self.metrics = MetricLogger(self.tb_run_dir, self.rank, cfg.metrics.enable_tensorboard,
                                        cfg.metrics.save_for_all_ranks)
            self.metrics.log_run_start(prep.config_text(), run_hparams(cfg, self.dims), list(RUN_METRICS),
                                       memory_layout(pp, cuda=device.type == "cuda", live_handles=counts_handles))
            self.checkpoint = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, self.model_parts,
                                                self.optimizers, self.lr_schedulers, self.train_loader)
            self.start_step = self.checkpoint.load()
            signals = parse_signals(cfg.checkpoint.preemption_signals)
            # a gloo group of its own: the flag is a CPU tensor, and polling it never waits for a device
            self._flag_group = dist.new_group(backend="gloo") if signals and dist.is_initialized() else None
            self.preemption = Preemption(signals, self._flag_group)
            self.preempted: Stop | None = None
            """How a preemption ended this run (set when the ranks agreed to stop)."""
            if dist.is_initialized() and self.dims.world_size > 1 and devices.store() is not None:
                self.heartbeat = Heartbeat(devices.store(), self.rank, self.dims.world_size,
                                           cfg.comm.init_timeout_seconds)
            self.collective_timeout_s = cfg.comm.init_timeout_seconds  # the process groups' until the first steps
            if cfg.comm.init_timeout_steps == 0 and dist.is_initialized():
                self._enter_train_timeout()
            source = f"HF config {cfg.model.hf_config_path}" if cfg.model.hf_config_path else cfg.model.flavor
            logger.info("model %s (%s): %.2fM params (%.2fM active per token), %.1f MFLOP/token, device %s, "
                        "world %d", cfg.model.name, source, self.total_params / 1e6, self.active_params / 1e6,
                        self.flops_per_token / 1e6, device, self.dims.world_size)
            # whatever compiles while training (the blocks and loss of [compile], the BF16-moment step on CUDA): a
            # line per compile; measured inside `train` only
            self.compile_times = CompileTimes()
            if self.start_step < cfg.training.steps:
                self._announce_compile()
        except BaseException:
            self._close_after_failed_start()
            raise

    def _new_tensorboard_run(self) -> str:
        """This run's tensorboard folder `<dump>/tb/<run id>`: created by rank 0, its path broadcast so that every
        rank writes into the same run."""
        tb_folder = os.path.join(self.cfg.job.dump_folder, "tb")
        path = [new_run_dir(tb_folder, label=run_name(self.cfg, self.dims)) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(path, src=0)
        parent = os.path.dirname(os.path.abspath(self.cfg.job.dump_folder))
        logger.info("tensorboard: this run writes to %s; compare it with the other runs of this job: tensorboard "
                    "--logdir %s (with every job under %s: --logdir %s)", path[0], tb_folder, parent, parent)
        return path[0]

    def _announce_compile(self) -> None:
        """Say before the first step that it will compile, and for about how long (the first step is silent)."""
        cfg = self.cfg.compile
        if not cfg.enable:
            return
        units_of = self.spec.plan.compile_units or (lambda part: [])
        blocks, graphs = first_compile([unit for part in self.model_parts for unit in units_of(part)])
        loss = "loss" in cfg.components
        graphs += loss
        what = f"compiling {blocks} blocks{' and the loss' if loss else ''} ({graphs} graphs)"
        if self.device.type != "cpu":
            logger.info("%s: the first step takes longer", what)
            return
        # the per-graph time was measured on CPU only: an estimate for CPU runs, nothing claimed elsewhere
        logger.info("%s: the first step takes ~%d s longer (~%d s per graph, the cold compile time measured on a "
                    "2-core CPU, docs/compile.md; less with a warm inductor cache)", what, graphs * SECONDS_PER_GRAPH,
                    SECONDS_PER_GRAPH)

    def _enter_train_timeout(self) -> None:
        """After the first steps (compile, warm-up): the heartbeat's timeout becomes the train timeout, and the
        collectives' the train timeout plus a margin, so that a silent rank is named before a collective times out
        without naming anyone (trainer/watchdog.py)."""
        seconds = self.cfg.comm.train_timeout_seconds
        self.collective_timeout_s = seconds + COLLECTIVE_MARGIN_S
        set_process_group_timeouts(self.collective_timeout_s)
        if self.heartbeat is not None:
            self.heartbeat.timeout, self.heartbeat.timeout_key = seconds, "comm.train_timeout_seconds"

    def _stop_for_preemption(self, step: int) -> None:
        """The ranks agreed on a preemption signal: save the state after `step` (nothing when no step of this run
        finished: it is saved already) and record it in `preempted`; the caller leaves the loop, `run` reports it and
        the process ends with exit code 0 (trainer/preemption.py)."""
        if step <= self.start_step:
            self.preempted = self.preemption.stop(step)
            return
        t0 = time.perf_counter()
        if not self.cfg.checkpoint.enable and self.rank == 0:
            logger.info("checkpoint.enable is false: the preemption checkpoint goes to %s, which the same command "
                        "resumes from", self.checkpoint.folder)
        with self._checkpoint_save("preemption checkpoint save"):
            path = self.checkpoint.save_now(step, marker={"step": step, "signal": self.preemption.received.name})
        self.preempted = self.preemption.stop(step, path, time.perf_counter() - t0)

    def _advance(self, point: str, step: int | None = None, patience: float = 0.0) -> None:
        """This rank reached `point` of the loop: its heartbeat's position moves on (trainer/watchdog.py)."""
        if self.heartbeat is not None:
            self.heartbeat.advance(point, step, patience)

    @contextlib.contextmanager
    def _checkpoint_save(self, point: str):
        """A save may take far longer than a step (a large model, a shared file system): while it runs, neither
        the heartbeat's progress rule nor a collective of the save counts it as a hang before
        `comm.checkpoint_timeout_seconds`."""
        seconds = self.cfg.comm.checkpoint_timeout_seconds
        self._advance(point, patience=seconds)
        if dist.is_initialized():
            set_process_group_timeouts(seconds + COLLECTIVE_MARGIN_S)
        try:
            yield
        finally:
            if dist.is_initialized():
                set_process_group_timeouts(self.collective_timeout_s)

    def _load_hf_weights(self, path: str) -> None:
        """Initial weights from a HF checkpoint directory, read in full on every rank, then sharded."""
        full = self.spec.checkpoints.hf.read_hf_state_dict(path, self.model_args, torch.float32,
                                                               partial=self.cfg.checkpoint.allow_partial_load)
        for part in self.model_parts:
            set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))
        logger.info("initial weights loaded from HF checkpoint %s", path)

    def _all_reduce_sum(self, t: torch.Tensor, with_pp: bool = False) -> torch.Tensor:
        """Sum over the ranks holding other tokens, data- and context-parallel (and over pipeline stages when only
        the last stage holds a value)."""
        if self.dp_group is not None:
            dist.all_reduce(t, group=self.dp_group)
        if with_pp and self.pp_group is not None:
            dist.all_reduce(t, group=self.pp_group)
        return t

    def _host_sum(self, count: int | torch.Tensor) -> int:
        """A host-side count (tokens of the batch) summed over the data- and context-parallel ranks. Its tensor stays
        on the CPU, so the reduction runs on the host backend (gloo; the process group has it beside NCCL,
        `trainer/device.py`) and never waits for the device."""
        total = torch.tensor(count.tolist() if isinstance(count, torch.Tensor) else count, dtype=torch.int64)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return total.tolist()

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: int) -> torch.Tensor:
        """Accumulate gradients of sum-CE / global_tokens over this rank's batch; return the local loss sum."""
        lbs = self.cfg.training.local_batch_size
        loss_sum = torch.zeros((), device=self.device)
        model = self.model_parts[0]
        if self.schedule is not None:
            self.pp_loss.scale = 1.0 / global_tokens
        count = -(-inputs.shape[0] // lbs)
        for start in range(0, inputs.shape[0], lbs):
            self._advance("the pipeline schedule (forward/backward of every microbatch)" if self.schedule is not None
                          else f"forward/backward of microbatch {start // lbs + 1}/{count}")
            x = devices.to_device(inputs[start:start + lbs], self.device)
            y = devices.to_device(labels[start:start + lbs], self.device)
            if self.schedule is not None:
                # the schedule splits the local batch into pipeline microbatches and runs forward and backward
                losses = [] if self.has_last_stage else None
                # forward ops count as forward, autograd's own ranges inside as backward (benchmarks/throughput.py)
                with record_function("phase/forward"):
                    self.schedule.step(*((x,) if self.has_first_stage else ()),
                                       target=y if self.has_last_stage else None, losses=losses)
                if self.has_last_stage:
                    loss_sum += torch.stack([loss.detach() for loss in losses]).sum() * global_tokens
                continue
            with record_function("phase/forward"), self.autocast:
                out = model(x)
                micro_loss = self.loss_fn(out, y)
            del out  # free the logits before backward allocates their gradient
            (micro_loss / global_tokens).backward()
            loss_sum += micro_loss.detach()
            if start + lbs < inputs.shape[0] and self.preemption.requested():
                raise PreemptedError
        return loss_sum

    def train_step(self, step: int) -> dict[str, float | torch.Tensor]:
        """One optimizer step over the global batch; returns the scalars to log. Device values stay 0-d tensors
        (the loss, the gradient norm, whether the step was skipped as non-finite, the model's statistics): the
        loop reads them at its next logging step, all in one transfer (`trainer/step_scalars.py`)."""
        cfg = self.cfg
        position = self.train_loader.state_dict() if self.preemption.signals else None
        data_start = time.perf_counter()
        with record_function("phase/data"):
            inputs, labels = self.train_loader.next_batch()
        data_s = time.perf_counter() - data_start
        self._advance("counting the batch's tokens")
        own_labels = own_share(self.context_parallel, labels)
        global_tokens = self._host_sum(count_valid_tokens(own_labels))
        self.spec.hooks.before_step(self.model_parts, global_tokens)

        try:
            loss_sum = self._forward_backward(inputs, labels, global_tokens)
        except PreemptedError:  # stopped between microbatches: as if this step had not started
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self.train_loader.load_state_dict(position)
            raise
        self._advance("gradient clipping and optimizer step")
        with record_function("phase/optimizer"):
            params = [p for part in self.model_parts for p in part.parameters()]
            if self._clip_in_step:
                grad_norm = global_grad_norm(params, self.pp_group)
                grad_scale = clip_grad_scale(grad_norm, cfg.training.max_norm)
            else:
                grad_norm, grad_scale = clip_grad_norm_(params, cfg.training.max_norm, self.pp_group), None
            loss = self._all_reduce_sum(loss_sum, with_pp=True) / global_tokens
            lr = self.lr_schedulers[0].get_last_lr()[0]
            nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
            self._optimizer_step(nonfinite, grad_scale)
            for sched in self.lr_schedulers:
                sched.step()
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            scalars = self.spec.hooks.post_optimizer_step(self.model_parts, cfg.moe, self.dp_group)
        scalars.update({"loss": loss, "grad_norm": grad_norm, _NONFINITE: nonfinite, "lr": lr,
                        "local_tokens": own_labels.numel(), "global_tokens": global_tokens, _DATA_S: data_s})
        return scalars

    def _optimizer_step(self, nonfinite: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """Step every optimizer unless the step's loss or gradient norm is not finite. A fused AdamW (and the
        bf16-moment one) skips on the device, given the flag as `found_inf` (the hook torch's GradScaler uses), so
        the host never waits for the decision; torch's foreach and for-loop AdamW take no such flag, and the host
        reads it (one wait per step, as torch's GradScaler does for them). `grad_scale`: the clipping's divisor,
        for optimizers that divide in their kernel (the same hook), else None (clipped in place)."""
        if self._skips_on_device:
            found_inf = nonfinite.float()
            for opt in self.optimizers:
                opt.found_inf, opt.grad_scale = found_inf, grad_scale
                opt.step()
        elif not read_to_host([nonfinite])[0]:
            for opt in self.optimizers:
                opt.step()

    def _handle_nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        """A non-finite loss or grad norm: the update was skipped; stop the run if the config says so."""
        message = f"step {step}: non-finite loss ({loss}) or grad norm ({grad_norm})"
        if self.cfg.training.on_nonfinite == "stop":
            raise TrainingError(message + "; stopping (training.on_nonfinite = stop)")
        logger.warning("%s; optimizer update skipped", message)

    @torch.no_grad()
    def validate(self) -> torch.Tensor:
        """Mean loss over the first `validation.steps` batches of the validation data, in eval mode with no_grad
        (no expert-bias counting), as a 0-d device tensor (read with the step's other values)."""
        self.val_loader.load_state_dict(self._val_start)
        for part in self.model_parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        tokens = 0
        try:
            lbs = self.cfg.training.local_batch_size
            for index in range(self.cfg.validation.steps):
                if index and self.preemption.requested():
                    raise PreemptedError
                self._advance(f"validation batch {index + 1}/{self.cfg.validation.steps}")
                inputs, labels = self.val_loader.next_batch()
                tokens += count_valid_tokens(own_share(self.context_parallel, labels)).tolist()
                for start in range(0, inputs.shape[0], lbs):
                    x = devices.to_device(inputs[start:start + lbs], self.device)
                    y = devices.to_device(labels[start:start + lbs], self.device)
                    with self.autocast:
                        if self.pipeline is not None:
                            seq = x.shape[1] // (self.context_parallel.degree if self.context_parallel else 1)
                            out = self.pipeline.forward(x, (x.shape[0], seq, self.model_args.dim))
                            if out is not None:
                                total += self.loss_fn(out, y)
                            continue
                        total += self.loss_fn(self.model_parts[0](x), y)
        finally:
            for part in self.model_parts:
                part.train()
        return self._all_reduce_sum(total, with_pp=True) / self._host_sum(tokens)

    def train(self, history: list[dict] | None = None,
              around_step: Callable[[int], contextlib.AbstractContextManager] | None = None) -> list[float]:
        """Run `training.steps` steps; returns the loss of every step (and appends all scalars to `history`).

        `around_step(step)`, when given, is a context entered around each step's `train_step` (a benchmark times or
        profiles steps with it; the step's phases are labelled `phase/data`, `phase/forward` and
        `phase/optimizer` for the profiler, backward is autograd's own). Ends with a one-line summary of the run
        on rank 0.
        """
        cfg = self.cfg
        losses = []
        summary = RunSummary(time.perf_counter())
        steps = range(self.start_step + 1, cfg.training.steps + 1)
        if self.preemption.requested():  # a signal during start-up, config or checkpoint load
            self._stop_for_preemption(self.start_step)
            steps = range(0)
        pending = PendingSteps()
        with self.memory, self.snapshots, self.compile_times, self._logged_on_error(pending, summary, losses, history):
            self._window_start = time.perf_counter()
            for step in steps:
                self._advance("reading its batch", step)
                try:
                    with data_errors_at(cfg, step, self.rank, validation=False), \
                            (around_step(step) if around_step else contextlib.nullcontext()):
                        scalars = self.train_step(step)
                except PreemptedError:  # between microbatches: the step was rolled back
                    self._log_pending(pending, summary, losses, history)
                    self._stop_for_preemption(step - 1)
                    break
                self._advance("metrics and logging")
                mem = self.memory.step_end()
                self.snapshots.step_end(step)
                record = StepRecord(step, scalars, MemoryMonitor.to_scalars(mem), scalars.pop("local_tokens"),
                                    scalars.pop("global_tokens"), scalars.pop(_DATA_S))
                verdict = None
                if mem.allocated_bytes is not None:  # the detector must never see unmeasured memory
                    verdict = self.leak_detector.update(step, mem.allocated_bytes, mem.breakdown)
                    record.rank_scalars.update(self.leak_detector.scalars(verdict))
                # the comm backend's own scalars, measured at step end (e.g. handles alive past the step)
                comm = self.comm_backend.metrics() if self.comm_backend is not None else {}
                live_handles, handle_verdict = comm.pop(HANDLES_TAG, None), None
                if live_handles is not None:
                    record.rank_scalars[HANDLES_TAG] = live_handles
                    handle_verdict = self.handle_detector.update(step, live_handles)
                    record.rank_scalars.update(self.handle_detector.scalars(handle_verdict))
                alarms = tuple(kind for kind, detector, v in (("memory", self.leak_detector, verdict),
                                                              ("handles", self.handle_detector, handle_verdict))
                               if v is not None and v is detector.alarm)
                table = self.cross_rank.gather(memory_values(mem, verdict, self.device_bytes, live_handles), alarms)
                if table is not None:  # rank 0: the spread over the ranks, and who holds the most
                    scalars.update(table.scalars())
                    summary.add_table(table)
                    for kind, watched in (("memory", MEMORY), ("handles", HANDLES)):
                        if table.alarms(kind):
                            scalars.update({watched.alarm_tag: 1.0,
                                            watched.alarm_rank_tag: float(table.alarms(kind)[0])})
                stop = False
                validated = self.val_loader is not None and step % cfg.validation.freq == 0
                if validated:
                    try:
                        with data_errors_at(cfg, step, self.rank, validation=True):
                            scalars["validation/loss"] = self.validate()
                    except PreemptedError:  # the step itself is done: its checkpoint is saved below
                        stop = True
                scalars.update(comm)
                pending.add(record)
                # rank 0 logs any rank's alarm at once, with the ranks holding the most
                alarm = bool(alarms) or (table is not None and bool(table.alarms("memory") + table.alarms("handles")))
                # a step that logs nothing reads nothing from the device; "stop" must know each step's verdict now
                if self._logs_at(step) or validated or alarm or cfg.training.on_nonfinite == "stop":
                    self._log_pending(pending, summary, losses, history, table, alarm=alarm)
                # after the step is logged: the alarm's step and slope are in tensorboard when the run stops
                self.leak_detector.check()
                self.handle_detector.check()
                if self.checkpoint.due(step, last=step == cfg.training.steps):
                    with self._checkpoint_save("checkpoint save"):
                        self.checkpoint.maybe_save(step, last=step == cfg.training.steps)
                if step == self.start_step + cfg.comm.init_timeout_steps and dist.is_initialized():
                    self._enter_train_timeout()
                self._advance("the end of step (preemption poll)")
                if stop or self.preemption.requested():
                    self._log_pending(pending, summary, losses, history)
                    self._stop_for_preemption(step)
                    break
        self.checkpoint.finish()  # the summary names the last checkpoint: an async save must be published first
        if summary.steps or self.preempted is None:  # preempted before its first step: its line says it all
            self._log_summary(summary)
        return losses

    @contextlib.contextmanager
    def _logged_on_error(self, pending: PendingSteps, summary: RunSummary, losses: list[float],
                         history: list[dict] | None) -> Iterator[None]:
        """When the loop raises, the steps it finished but has not logged yet (between logging steps) still reach
        the console, tensorboard and `history`; a failure of that read (the device itself failed) is secondary and
        leaves the loop's error to propagate."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self._log_pending(pending, summary, losses, history)
            raise

    def _logs_at(self, step: int) -> bool:
        """Whether `step` is a logging step: every `metrics.log_freq`-th, the run's first (the reference the later
        losses are read against) and its last."""
        return step % self.cfg.metrics.log_freq == 0 or step in (self.start_step + 1, self.cfg.training.steps)

    def _log_pending(self, pending: PendingSteps, summary: RunSummary, losses: list[float],
                     history: list[dict] | None, table: RankTable | None = None, alarm: bool = False) -> None:
        """Read the pending steps' device values (one host transfer) and log them: every step's scalars to
        tensorboard at its own step, the throughput of the steps since the last logging step (tokens over wall
        time: the rate as training runs, with no wait for the device in between; the job's and this rank's),
        non-finite steps, and at a logging step the experts' load as an image, the rank holding the most of each
        field of this step's memory `table` (text; at a leak `alarm` too) and the console line (rank 0)."""
        if not len(pending):
            return
        logs = table is not None and self._logs_at(pending.last_step)
        records = pending.flush(arrays=logs and self.metrics.writes and self.cfg.metrics.expert_load_images)
        now = time.perf_counter()
        seconds, self._window_start = now - self._window_start, now
        tokens_per_s = sum(r.local_tokens for r in records) / seconds
        job_tokens_per_s = sum(r.global_tokens for r in records) / seconds
        # the share of this rank's wall time spent reading batches (tokenising as it reads, every rank tokenises the
        # whole global batch; pre-tokenized, only its own sequences: docs/data.md), as torchtitan's data_loading(%)
        data_pct = 100 * sum(r.data_s for r in records) / seconds
        for record in records:
            scalars, last = record.scalars, record is records[-1]
            rows = rows_of({tag: scalars.pop(tag) for tag in [t for t, v in scalars.items() if isinstance(v, list)]})
            if scalars.pop(_NONFINITE):
                self._handle_nonfinite(record.step, scalars["loss"], scalars["grad_norm"])
            losses.append(scalars["loss"])
            summary.add_step(record.step, scalars["loss"], record.global_tokens, seconds if last else 0.0)
            if "validation/loss" in scalars:
                summary.validation = (record.step, scalars["validation/loss"])
                logger.info("step %d validation loss %.4f", record.step, scalars["validation/loss"])
            if last:
                scalars["throughput/job_tokens_per_s"] = job_tokens_per_s
                if self.rank == 0:  # the run folder's: rank 0's own rate, named so
                    scalars.update({"throughput/rank0_tokens_per_s": tokens_per_s,
                                    "throughput/rank0_tflops": tokens_per_s * self.flops_per_token / 1e12,
                                    "throughput/rank0_data_loading_pct": data_pct})
                record.rank_scalars.update({"throughput/rank_tokens_per_s": tokens_per_s,
                                            "throughput/rank_data_loading_pct": data_pct})
            self.metrics.log(record.step, scalars, record.rank_scalars)
            if rows:
                self.metrics.log_image(record.step, IMAGE_TAG, expert_load_image(rows, self.dims.ep))
            if history is not None:
                history.append({**record.rank_scalars, **scalars})
        if table is not None and (logs or alarm):
            self.metrics.log_text(records[-1].step, WORST_RANK_TAG, table.worst_rank_text())
        if logs:
            self._console(records[-1].step, records[-1].scalars, job_tokens_per_s, table)

    def _console(self, step: int, scalars: dict[str, float], tokens_per_s: float, table: RankTable) -> None:
        """The step's console line (rank 0): memory of the rank with the largest peak, named when there are
        several ranks."""
        worst = table.worst("peak_allocated_GiB") or table.worst("rss_GiB")
        rank = worst[0] if worst is not None and table.world_size > 1 else None
        row = table.rows[worst[0] if worst is not None else 0]
        value = {field: None if math.isnan(x) else x for field, x in zip(FIELDS, row)}
        self.metrics.console(step, scalars["loss"], scalars["grad_norm"], tokens_per_s, value["allocated_GiB"],
                             value["peak_allocated_GiB"], scalars["lr"], rss_GiB=value["rss_GiB"],
                             worst_rank=rank)

    def _log_summary(self, summary: RunSummary) -> None:
        """One line on rank 0 at the end of the run (`RunSummary.line`), with the largest peak over the ranks (the
        one that decides whether a layout fits) and the rank that had it; the HParams row's metrics."""
        if self.rank != 0:
            return
        summary.compile_s = self.compile_times.seconds
        if self.preempted is None:  # a preempted run ends with the preemption's line instead (step, checkpoint)
            logger.info("run done: %s", summary.line(self.start_step, self.cfg.training.steps, self.tb_run_dir,
                                                     self.checkpoint.last_published))
        if summary.steps:
            self.metrics.log_run_end(summary.last_step, summary.run_metrics())

    def close(self) -> None:
        """Release what the run opened: signal handlers, the heartbeat thread, pending checkpoint saves, the metric
        writers and the preemption-flag group; the process groups get back the timeouts of new groups. Closes only
        what was opened when ``__init__`` failed part-way (it calls this itself)."""
        for step in self._closing_steps():
            step()

    def _closing_steps(self) -> list:
        """What ``close`` runs, in order: one callable per thing opened."""
        steps = [opened.close for opened in (self.preemption, self.heartbeat) if opened is not None]
        if self.checkpoint is not None:
            steps.append(self.checkpoint.finish)
        if self.metrics is not None:
            steps.append(self.metrics.close)
        if dist.is_initialized():
            steps.append(self._reset_timeouts)
            if self._flag_group is not None:
                steps.append(self._destroy_flag_group)
        return steps

    def _reset_timeouts(self) -> None:
        # the next job of this process gets the mesh groups (parallelisms/mesh.py) as new ones, not at this job's
        # train timeout, which would end its first compile
        reset_process_group_timeouts(self.cfg.comm.init_timeout_seconds)

    def _destroy_flag_group(self) -> None:
        # only plain collectives ran on it: once unreferenced, it is freed
        dist.destroy_process_group(self._flag_group)
        self._flag_group = None
        if self.preemption is not None:
            self.preemption.group = None

    def _close_after_failed_start(self) -> None:
        """``close`` for an ``__init__`` that raised: the caller gets no trainer to close, and the exception it sees
        stays the one that stopped the start. Each step runs even when one before it failed (logged, not raised
        over that exception)."""
        for step in self._closing_steps():
            try:
                step()
            except Exception:
                logger.exception("closing what a trainer opened before its start failed: %s failed",
                                 step.__qualname__)


def run(cfg: JobConfig, shutdown: bool = True, history: list[dict] | None = None) -> list[float]:
    """Train with an already loaded config in this process; returns the loss of every step.

    `shutdown=False` keeps the process group alive so a test can run several jobs in one launch; `history`
    receives every step's logged scalars.
    """
    world_size, rank = devices.world_size_from_env(), int(os.environ.get("RANK", 0))
    prep = prepare(cfg, world_size, rank)
    device = devices.init_distributed(timeout_s=cfg.comm.init_timeout_seconds)
    init_logging(devices.rank())
    if devices.rank() == 0:
        if prep.auto_layout is not None:
            logger.info(prep.auto_layout)
        if prep.ac_budget is not None:
            logger.info("\n".join(prep.ac_budget))
        warn_settings_without_effect(prep, device)
        if user_force_modules(cfg.activation_checkpoint):  # judged once against the whole model, not per stage
            with torch.device("meta"):
                warning = force_modules_warning(cfg.activation_checkpoint, prep.spec.model_cls(prep.model_args))
            if warning is not None:
                logger.warning(warning)
        if prep.checkpoint_note is not None:
            logger.warning(prep.checkpoint_note)
        if prep.batch_note is not None:
            logger.info(prep.batch_note)
    trainer = None
    try:
        trainer = Trainer(prep, device)
        if trainer.rank == 0:
            _report_restart(trainer.checkpoint.resumed_from, trainer.start_step)
        losses = trainer.train(history)
    finally:
        if trainer is not None:
            trainer.close()
        if shutdown:
            devices.shutdown_distributed()
    if trainer.preempted is not None:
        _report_preemption(trainer.preempted, trainer.rank)
    return losses


def _report_preemption(stop: Stop, rank: int) -> None:
    """The line of a preemption, as the last thing before the exit (it gives the time from the signal to the exit):
    left by every rank for its node's launcher, which prints it once and exits 75; logged by rank 0 when no launcher
    prints it."""
    line = stop.line()
    if rank == 0 and not launched():
        logger.warning(line)
    leave_marker(f"{PREEMPTED_PREFIX}{rank}", line)


def _report_restart(path: str | None, start_step: int) -> None:
    """In rank 0 of an elastic restart, one warning: which rank failed and how, and where the run resumes (`path`,
    the checkpoint the run loaded: after a fallback past a corrupt one, not the latest)."""
    resumed = (f"resuming from {path} (step {start_step})" if path else
               "starting again from step 1: there is no checkpoint to resume from (checkpoint.enable)")
    line = restart_line(resumed)
    if line is not None:
        logger.warning(line)


def _main(argv: list[str]) -> None:
    cfg = load_command_config(argv)
    listen(parse_signals(cfg.checkpoint.preemption_signals))  # main() listened to the default signals
    if cfg.job.print_config:
        # the checks of a launch first: an invalid config is reported as such, not printed
        rank = int(os.environ.get("RANK", 0))
        prep = prepare(cfg, devices.world_size_from_env(), rank)
        if rank == 0:
            print(prep.config_text(), end="")
        return
    run(cfg)


def _data_error_line(error: DatasetError) -> str:
    """One line for a dataset error found after launch: where (step, rank, training or validation), the config key
    and the document at fault (`data_errors_at` marks the first two)."""
    where = f" at {error.where}" if error.where else ""
    key = error.config_key or f"dataset.{error.key}"
    allowed = f"; allowed: {error.allowed}" if error.allowed else ""
    return " ".join(f"data error{where}: {key}: {error.problem}{allowed}".split())


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point. Every error it knows ends the same way as a preflight error: its one line, no
    traceback, and the exit code of docs/errors.md: 2 bad input (config, checkpoint, data), 1 a training error, 130
    interrupted. The line is left for `trainer.launch` in torchrun's error file, and the launcher prints it once for
    the job; without a launcher the rank prints it on stderr (`report_line`).

    The process ends through `devices.end_process` (a process group may outlive its shutdown, see there).
    """
    argv = sys.argv[1:] if argv is None else argv
    code, line, lost_peer = 0, None, False
    try:
        _main(argv)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        line, code = "interrupted", 130
    except ConfigError as e:
        line, code = str(e), 2
    except CheckpointError as e:
        line, code = f"checkpoint error: {e}", 2
    except CheckpointSaveError as e:
        line, code = f"checkpoint error: {e}", 1
    except DatasetError as e:
        line, code = _data_error_line(e), 2
    except (TrainingError, MemoryLeakError) as e:
        line, code = f"training error: {e}", 1
    except RuntimeError as e:
        if not _lost_peer(e):
            raise
        # another rank failed or was stopped first: the launcher names that one (trainer/launch.py, `_order`)
        line = f"communication error on rank {devices.rank()}: {' '.join(str(e).split())[:300]}"
        code, lost_peer = 1, True
    if line is not None:
        report_line(line, lost_peer)
    devices.end_process(code)


def _lost_peer(error: RuntimeError) -> bool:
    """A collective that failed because a peer died or did not answer within the timeout."""
    return isinstance(error, dist.DistError) or "third_party/gloo" in str(error)


if __name__ == "__main__":
    main()
