"""Metrics out of the train loop: tensorboard scalars, one console line per logged step, and logging setup.

Tensorboard layout: every run writes into its own folder ``<job.dump_folder>/tb/<run id>/`` (``new_run_dir``), so
runs sharing a dump folder (a second run, a resume, an elastic restart) never mix their curves; ``tensorboard
--logdir <job.dump_folder>/tb`` shows them as separate runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from core.config import option


@dataclass
class MetricsSection:
    """Logging of loss, throughput and memory."""

    log_freq: int = option(1, ge=1)
    """Log metrics every this many steps."""
    enable_tensorboard: bool = True
    """Write tensorboard event files under dump_folder."""
    save_for_all_ranks: bool = False
    """Write metrics from every rank, not just rank 0 (useful to see per-rank memory or imbalance)."""


__all__ = ["MetricLogger", "init_logging", "new_run_dir", "read_scalars", "run_dirs"]

RUN_ID_FORMAT = "%Y%m%d-%H%M%S"
"""A run id is the UTC start time in this format, with ``_<n>`` appended for the n-th run of the same second."""
_RUN_ID = re.compile(r"^(\d{8}-\d{6})(?:_(\d+))?$")

logger = logging.getLogger(__name__)


class _RankHandler(logging.StreamHandler):
    """The stream handler ``init_logging`` installs; its own class so a second call can find and replace it."""


def init_logging(rank: int, info_on_all_ranks: bool = False) -> None:
    """Configure the root logger for a distributed run.

    Rank 0 prints INFO and above; other ranks print WARNING and above (INFO too with ``info_on_all_ranks``), with
    a ``[rank r]`` prefix so interleaved output can be told apart. Calling it again replaces the earlier setup and
    leaves handlers installed by others (e.g. pytest's) alone.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RankHandler)]:
        root.removeHandler(handler)
    handler = _RankHandler(sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 or info_on_all_ranks else logging.WARNING)


class MetricLogger:
    """Writes scalars to tensorboard and prints a compact progress line.

    Tensorboard files go to ``log_dir`` from rank 0 only, or with ``save_for_all_ranks`` to ``log_dir/rank_<r>``
    from every rank (rank 0 included, so that all ranks sit side by side). Nothing is written when
    ``enable_tensorboard`` is false or ``log_dir`` is None. The console line is printed by rank 0 only.
    """

    def __init__(self, log_dir: str | None, rank: int, enable_tensorboard: bool, save_for_all_ranks: bool) -> None:
        self.rank = rank
        self.log_dir: str | None = None
        if enable_tensorboard and log_dir is not None and (save_for_all_ranks or rank == 0):
            self.log_dir = os.path.join(log_dir, f"rank_{rank}") if save_for_all_ranks else log_dir
        self._writer: Any = None
        if self.log_dir is not None:
            # Imported here: the import costs time (docs/performance.md, "Start-up costs") that runs without
            # tensorboard should not pay.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir)
        self._closed = False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Write each scalar under its tag at ``step`` (nothing on ranks without a writer)."""
        if self._closed:
            raise RuntimeError("MetricLogger.log() after close()")
        if self._writer is None:
            return
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def console(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        tokens_per_s: float,
        mem_current_GiB: float | None,
        mem_peak_GiB: float | None,
        lr: float,
        extra: dict[str, float] | None = None,
        rss_GiB: float | None = None,
    ) -> None:
        """Log one aligned progress line on rank 0, e.g.
        ``step    3  loss  7.1234  grad_norm   1.234  tok/s    12,345  mem 0.12/0.34 GiB  lr 8.0e-04``.

        The memory field shows tensor memory at step end / peak within the step; where those were not measured
        (``None``) the process RSS instead (``rss 1.23 GiB``), and nothing when neither was. ``extra`` items are
        appended as ``name value`` (integers as they are, other numbers with 4 significant digits).
        """
        if self.rank != 0:
            return
        if mem_current_GiB is not None and mem_peak_GiB is not None:
            memory = f"mem {mem_current_GiB:.2f}/{mem_peak_GiB:.2f} GiB  "
        elif rss_GiB is not None:
            memory = f"rss {rss_GiB:.2f} GiB  "
        else:
            memory = ""
        line = (
            f"step {step:>4}  loss {loss:7.4f}  grad_norm {grad_norm:7.3f}  tok/s {tokens_per_s:>9,.0f}  "
            f"{memory}lr {lr:.1e}"
        )
        for name, value in (extra or {}).items():
            line += f"  {name} {value}" if isinstance(value, int) else f"  {name} {value:.4g}"
        logger.info(line)

    def close(self) -> None:
        """Flush and close the tensorboard writer. Idempotent, so it is safe in ``finally`` and after Ctrl-C."""
        self._closed = True
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the event files directly in ``log_dir``, as ``{tag: [(step, value), ...]}`` in write order.

    For tests and tools; ``size_guidance`` 0 keeps every point (the default reservoir-samples long runs).
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow, tools only

    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def new_run_dir(tb_folder: str, now: datetime | None = None) -> str:
    """Create and return a new run folder ``tb_folder/<run id>``; ``now`` (UTC) defaults to the current time.

    The folder is claimed with ``os.mkdir``, so two runs starting in the same second get two folders
    (``<id>`` and ``<id>_2``). Call it in one process of a run and hand the path to the others.
    """
    stamp = (now or datetime.now(timezone.utc)).strftime(RUN_ID_FORMAT)
    os.makedirs(tb_folder, exist_ok=True)
    for n in itertools.count(1):
        path = os.path.join(tb_folder, stamp if n == 1 else f"{stamp}_{n}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path


def run_dirs(tb_folder: str) -> list[str]:
    """The run folders in ``tb_folder`` (those named by a run id), oldest first."""
    runs = []
    for name in os.listdir(tb_folder) if os.path.isdir(tb_folder) else []:
        match = _RUN_ID.match(name)
        if match and os.path.isdir(os.path.join(tb_folder, name)):
            runs.append((match.group(1), int(match.group(2) or 1), name))
    return [os.path.join(tb_folder, name) for *_, name in sorted(runs)]
