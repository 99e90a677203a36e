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
    """Also write every rank's own memory curves to <run folder>/rank_<r>/ (rank 0 always logs the spread over
    the ranks and the rank with the most memory in the run folder)."""


__all__ = ["MetricLogger", "init_logging", "new_run_dir", "read_hparams", "read_scalars", "run_dirs", "run_label"]

RUN_ID_FORMAT = "%Y%m%d-%H%M%S"
"""A run id is the UTC start time in this format, with ``_<n>`` appended for the n-th run of the same second and
``-<label>`` for what the run set (``new_run_dir``)."""
_RUN_ID = re.compile(r"^(\d{8}-\d{6})(?:_(\d+))?(?:-(.+))?$")
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._=,+-]+")
LABEL_MAX = 80
"""Characters of a run folder's label at most (a shared filesystem and tensorboard's run list stay readable)."""

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

    Two kinds of folders:
      * the run folder ``log_dir``, written by rank 0: the run's scalars (loss, throughput, the spread of memory
        over the ranks, MoE statistics), the merged config as text and the run's HParams row;
      * with ``save_for_all_ranks``, ``log_dir/rank_<r>`` from every rank (rank 0 included): that rank's own
        memory (allocated, peak, RSS or reserved, breakdown, leak slope) and tokens/s.
    Nothing is written when ``enable_tensorboard`` is false or ``log_dir`` is None. The console line is printed by
    rank 0 only.
    """

    def __init__(self, log_dir: str | None, rank: int, enable_tensorboard: bool, save_for_all_ranks: bool) -> None:
        self.rank = rank
        on = enable_tensorboard and log_dir is not None
        self.log_dir: str | None = log_dir if on and rank == 0 else None
        self.rank_dir: str | None = os.path.join(log_dir, f"rank_{rank}") if on and save_for_all_ranks else None
        self._writer: Any = self._open(self.log_dir)
        self._rank_writer: Any = self._open(self.rank_dir)
        self._closed = False

    @staticmethod
    def _open(path: str | None) -> Any:
        if path is None:
            return None
        # Imported here: the import costs time (docs/performance.md, "Start-up costs") that runs without
        # tensorboard should not pay.
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(path)

    def log(self, step: int, scalars: dict[str, float], rank_scalars: dict[str, float] | None = None) -> None:
        """Write the run's ``scalars`` to the run folder and this rank's ``rank_scalars`` to its rank folder, each
        under its tag at ``step`` (nothing where there is no writer)."""
        if self._closed:
            raise RuntimeError("MetricLogger.log() after close()")
        for writer, values in ((self._writer, scalars), (self._rank_writer, rank_scalars or {})):
            if writer is not None:
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)

    def log_run_start(self, config_toml: str, hparams: dict[str, Any], metric_tags: list[str],
                      layout: dict | None = None) -> None:
        """The run's merged config as text (tag ``config``), its HParams row: ``hparams`` (name -> a number, a
        string or a bool) with the scalars ``metric_tags`` as the row's metrics, which ``log_run_end`` writes, and
        a Custom Scalars ``layout`` (charts that draw several tags)."""
        if self._writer is None:
            return
        # tensorboard renders text as markdown: a fenced block keeps the TOML as it is
        self._writer.add_text("config", f"```toml\n{config_toml}```", 0)
        if layout:
            self._writer.add_custom_scalars(layout)
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        experiment, session_start, _ = hparams_summaries(hparams, dict.fromkeys(metric_tags, 0.0))
        for summary in (experiment, session_start):
            self._writer.file_writer.add_summary(summary)

    def log_run_end(self, step: int, metrics: dict[str, float]) -> None:
        """The HParams row's metrics (measured over the run), at the run's last step, and the session's end."""
        if self._writer is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, step)
        *_, session_end = hparams_summaries({}, {})
        self._writer.file_writer.add_summary(session_end)

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
        worst_rank: int | None = None,
    ) -> None:
        """Log one aligned progress line on rank 0, e.g.
        ``step    3  loss  7.1234  grad_norm   1.234  tok/s    12,345  mem 0.12/0.34 GiB  lr 8.0e-04``.

        The memory field shows tensor memory at step end / peak within the step; where those were not measured
        (``None``) the process RSS instead (``rss 1.23 GiB``), and nothing when neither was. With several ranks
        these are the largest rank's, and ``worst_rank`` (the rank with the largest peak) is named after them
        (``mem 0.12/0.34 GiB @rank 3``). ``extra`` items are appended as ``name value`` (integers as they are,
        other numbers with 4 significant digits).
        """
        if self.rank != 0:
            return
        at = f" @rank {worst_rank}" if worst_rank is not None else ""
        if mem_current_GiB is not None and mem_peak_GiB is not None:
            memory = f"mem {mem_current_GiB:.2f}/{mem_peak_GiB:.2f} GiB{at}  "
        elif rss_GiB is not None:
            memory = f"rss {rss_GiB:.2f} GiB{at}  "
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
        """Flush and close the tensorboard writers. Idempotent, so it is safe in ``finally`` and after Ctrl-C."""
        self._closed = True
        for name in ("_writer", "_rank_writer"):
            writer = getattr(self, name)
            setattr(self, name, None)
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


def read_hparams(log_dir: str) -> dict[str, float | str | bool]:
    """The HParams row a run folder's events hold (``MetricLogger.log_run_start``), empty without one. For tools
    and tests."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow, tools only
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    try:
        content = accumulator.PluginTagToContent("hparams").get("_hparams_/session_start_info")
    except KeyError:  # no HParams data at all
        content = None
    if content is None:
        return {}
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {name: getattr(value, value.WhichOneof("kind")) for name, value in hparams.items()}


def run_label(text: str) -> str:
    """``text`` as a run folder's label: characters a path and tensorboard's run filter take, at most
    ``LABEL_MAX`` of them."""
    return _LABEL_CHARS.sub("_", text).strip("_")[:LABEL_MAX]


def new_run_dir(tb_folder: str, now: datetime | None = None, label: str = "") -> str:
    """Create and return a new run folder ``tb_folder/<run id>[-<label>]``; ``now`` (UTC) defaults to the current
    time, ``label`` (``run_label``) says what the run set, so that runs are told apart in tensorboard's run list.

    The folder is claimed with ``os.mkdir``, so two runs starting in the same second get two folders
    (``<id>`` and ``<id>_2``). Call it in one process of a run and hand the path to the others.
    """
    stamp = (now or datetime.now(timezone.utc)).strftime(RUN_ID_FORMAT)
    suffix = f"-{run_label(label)}" if run_label(label) else ""
    os.makedirs(tb_folder, exist_ok=True)
    for n in itertools.count(1):
        path = os.path.join(tb_folder, (stamp if n == 1 else f"{stamp}_{n}") + suffix)
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
