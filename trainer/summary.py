"""What a run reports about itself as a whole: the end-of-run line (what ran, the last losses, the largest memory
and the rank that had it, where the outputs are) and the run's HParams row in tensorboard (the settings that shape
memory, with the run's peak, speed and loss), gathered step by step on rank 0."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from trainer.memory.ranks import RankTable
from trainer.metrics import layout_label

__all__ = ["RUN_METRICS", "RunSummary", "duration", "run_hparams"]

RUN_METRICS = ("run/peak_memory_GiB", "run/job_tokens_per_s", "run/final_loss", "run/compile_s")
"""The HParams table's metrics: the largest per-rank peak of tensor memory (process RSS where tensor memory was not
tracked), the whole job's tokens per second (every data-parallel rank's) after its first step, the loss of the
last step, and the seconds rank 0 spent compiling (`trainer/compile_times.py`; absent when nothing compiled)."""


def duration(seconds: float) -> str:
    """`42.0 s`, `3m07s` or `2h05m`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    return f"{minutes}m{int(seconds % 60):02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def run_hparams(cfg, dims) -> dict[str, Any]:
    """The settings that shape a run's memory and speed, as the HParams table's columns, in their display order:
    the layout in one column (`fsdp4.ep2`), the AC mode and the dtype first (tensorboard shows five columns by
    default, those that differ between the runs first), then each degree and the rest."""
    par, ac = cfg.parallelism, cfg.activation_checkpoint
    return {"layout": layout_label(dims), "ac_mode": ac.mode,
            "dtype": cfg.training.dtype, "world_size": dims.world_size, "dp_shard": dims.dp_shard, "ep": dims.ep,
            "pp": dims.pp, "cp": dims.cp, "dp_replicate": dims.dp_replicate,
            "comm_backend": par.expert_parallel_comm_backend,
            "ac_save_ops": ",".join(ac.save_ops) if ac.mode == "selective" else "-", "fp8": cfg.fp8.recipe,
            "compile": cfg.compile.enable, "pp_schedule": par.pipeline_parallel_schedule if dims.pp > 1 else "-",
            "local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
            "model": f"{cfg.model.name}/{cfg.model.hf_config_path or cfg.model.flavor}"}


@dataclasses.dataclass
class RunSummary:
    """The run so far, from its steps and (rank 0) their tables of every rank's memory."""

    start: float
    steps: int = 0
    first_step: int = 0
    last_step: int = 0
    tokens: int = 0
    loss: float = math.nan
    validation: tuple[int, float] | None = None
    timed_tokens: int = 0  # tokens and seconds of the steps after the first (compile, warm-up)
    timed_seconds: float = 0.0
    several_ranks: bool = False
    peak: tuple[str, float, str] | None = None  # (field, GiB, the rank with its place) of the largest peak
    compile_s: float = 0.0  # rank 0's torch.compile time while training (`Trainer.compile_times`)

    def add_step(self, step: int, loss: float, tokens: float, seconds: float) -> None:
        """Record one finished step: its loss, the global tokens it trained on and its duration."""
        if self.steps:
            self.timed_tokens += int(tokens)
            self.timed_seconds += seconds
        self.first_step = self.first_step or step
        self.steps, self.last_step, self.loss = self.steps + 1, step, loss
        self.tokens += int(tokens)

    def add_table(self, table: RankTable) -> None:
        """Keep the largest peak of tensor memory over every rank and step (the RSS when not tracked), with its
        rank."""
        self.several_ranks = table.world_size > 1
        for field in ("peak_allocated_GiB", "rss_GiB"):
            worst = table.worst(field)
            if worst is None:
                continue
            if self.peak is None or (self.peak[0] == field and worst[1] > self.peak[1]):
                self.peak = (field, worst[1], table.place(worst[0]))
            return

    def run_metrics(self) -> dict[str, float]:
        """The HParams row's metrics (`RUN_METRICS`), those measured."""
        metrics = {"run/final_loss": self.loss}
        if self.peak is not None:
            metrics["run/peak_memory_GiB"] = self.peak[1]
        if self.timed_seconds > 0:
            metrics["run/job_tokens_per_s"] = self.timed_tokens / self.timed_seconds
        if self.compile_s > 0:
            metrics["run/compile_s"] = self.compile_s
        return metrics

    def line(self, start_step: int, total_steps: int, tb_run_dir: str | None, checkpoint: str | None) -> str:
        """The summary (after "run done: ")."""
        if self.steps == 0:
            return f"nothing to train (resumed at step {start_step} of {total_steps})"
        compiling = f" ({duration(self.compile_s)} of it compiling)" if self.compile_s > 0 else ""
        parts = [f"steps {self.first_step}-{self.last_step} in {duration(time.perf_counter() - self.start)}{compiling}",
                 f"{self.tokens:,} tokens", f"final loss {self.loss:.4f}"]
        if self.validation is not None:
            parts.append(f"validation loss {self.validation[1]:.4f} (step {self.validation[0]})")
        if self.peak is not None:
            field, value, where = self.peak
            of = f" on {where}" if self.several_ranks else ""  # the largest of any rank
            parts.append(f"peak tensor memory {value:.2f} GiB{of}" if field == "peak_allocated_GiB"
                         else f"max RSS {value:.2f} GiB{of} (tensor memory not tracked)")
        parts.append(f"tensorboard {tb_run_dir}" if tb_run_dir else "tensorboard off")
        parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint")
        return ", ".join(parts)
