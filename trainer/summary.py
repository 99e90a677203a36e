"""The end-of-run line: what ran, the last losses, peak memory, and where the outputs are, gathered step by step."""

from __future__ import annotations

import dataclasses
import math
import time

from trainer.memory.monitor import MemoryStats

__all__ = ["RunSummary", "duration", "gib"]


def gib(nbytes: int | None) -> float | None:
    """Bytes in GiB; None (not measured) stays None."""
    return None if nbytes is None else nbytes / 2**30


def duration(seconds: float) -> str:
    """`42.0 s`, `3m07s` or `2h05m`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    return f"{minutes}m{int(seconds % 60):02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


@dataclasses.dataclass
class RunSummary:
    """What the end-of-run line reports, gathered step by step (this rank's view; peaks are reduced at the end)."""

    start: float
    steps: int = 0
    first_step: int = 0
    last_step: int = 0
    tokens: int = 0
    loss: float = math.nan
    validation: tuple[int, float] | None = None
    peak_tensor_bytes: int | None = None
    peak_rss_bytes: int | None = None

    def add_step(self, step: int, loss: float, tokens: float, mem: MemoryStats) -> None:
        """Record one finished step: its loss, the global tokens it trained on and its memory."""
        self.first_step = self.first_step or step
        self.steps, self.last_step, self.loss = self.steps + 1, step, loss
        self.tokens += int(tokens)
        if mem.peak_bytes is not None:
            self.peak_tensor_bytes = max(self.peak_tensor_bytes or 0, mem.peak_bytes)
        if mem.rss_bytes is not None:
            self.peak_rss_bytes = max(self.peak_rss_bytes or 0, mem.rss_bytes)

    def line(self, peak_tensor: int | None, peak_rss: int | None, several_ranks: bool, start_step: int,
             total_steps: int, tb_run_dir: str | None, checkpoint: str | None) -> str:
        """The summary (after "run done: "), with the peaks of the largest rank when there are `several_ranks`."""
        if self.steps == 0:
            return f"nothing to train (resumed at step {start_step} of {total_steps})"
        parts = [f"steps {self.first_step}-{self.last_step} in {duration(time.perf_counter() - self.start)}",
                 f"{self.tokens:,} tokens", f"final loss {self.loss:.4f}"]
        if self.validation is not None:
            parts.append(f"validation loss {self.validation[1]:.4f} (step {self.validation[0]})")
        of = " (largest rank)" if several_ranks else ""
        if peak_tensor is not None:
            parts.append(f"peak tensor memory {peak_tensor / 2**30:.2f} GiB{of}")
        elif peak_rss is not None:
            parts.append(f"max RSS {peak_rss / 2**30:.2f} GiB{of} (tensor memory not tracked)")
        parts.append(f"tensorboard {tb_run_dir}" if tb_run_dir else "tensorboard off")
        parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint")
        return ", ".join(parts)
