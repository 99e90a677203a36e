"""Metrics out of the train loop: tensorboard scalars, texts and images, the HParams table, one console line per
logged step, and logging setup.

Tensorboard layout: every run writes into its own folder ``<job.dump_folder>/tb/<run id>/`` (``new_run_dir``), so
runs sharing a dump folder (a second run, a resume, an elastic restart) never mix their curves; ``tensorboard
--logdir <job.dump_folder>/tb`` shows them as separate runs. The run id starts with what the run set (its label)
and ends with its UTC start time, so the start of every run name, HParams' Trial ID included, tells runs apart.

HParams: each run folder holds its row (a session named by the run folder); the table's columns are declared once
per tb folder, in ``<tb>/hparams_config/`` (``write_hparams_config``, rewritten at each run's start from every run of
the folder), because tensorboard takes one declaration for the whole logdir, and an arbitrary one where several
runs declare. tensorboard 2.21's table shows the first five columns by default, those whose value ``differs`` across
runs first, then by name: the names carry their display position (``00_layout``) and the declared display name
hides it. Integers are declared as strings of their digits (the table prints every number with five significant
digits, ``2.0000``), booleans as booleans.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace
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
    expert_load_images: bool = True
    """At each logging step, draw the tokens each expert of each MoE layer received as a heatmap image (tag
    moe/tokens_per_expert, tensorboard's Images tab; docs/memory.md). Off: the counts are never read."""


__all__ = ["HPARAMS_CONFIG_DIR", "MetricLogger", "init_logging", "layout_label", "new_run_dir", "read_hparams",
           "read_scalars", "read_texts", "run_dirs", "run_label", "write_hparams_config"]

RUN_ID_FORMAT = "%Y%m%d-%H%M%S"
"""A run id is ``<label>-`` (what the run set), then the UTC start time in this format, with ``_<n>`` appended for the
n-th run of the same second (``new_run_dir``)."""
_RUN_ID = re.compile(r"^(?:(.+)-)?(\d{8}-\d{6})(?:_(\d+))?$")
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._=,+-]+")
LABEL_MAX = 80
"""Characters of a run folder's label at most (a shared filesystem and tensorboard's run list stay readable)."""
HPARAMS_CONFIG_DIR = "hparams_config"
"""The folder, beside the run folders of a tb folder, that declares the HParams table's columns
(``write_hparams_config``; tensorboard lists it as a run without data)."""
_POSITION = re.compile(r"^\d{2}_(.+)$")  # an HParams column name with its display position: 00_layout

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


#: a rank folder's memory sizes (GiB), written to the nearest MiB
_RANK_SIZES = frozenset(f"memory/{name}_GiB" for name in ("allocated", "peak_allocated", "reserved", "rss"))


class MetricLogger:
    """Writes scalars, texts and images to tensorboard and prints a compact progress line.

    Two kinds of folders:
      * the run folder ``log_dir``, written by rank 0: the run's scalars (loss, throughput, the spread of memory
        over the ranks, MoE statistics), the rank holding the most of each (text), the experts' load (image), the
        merged config as text and the run's HParams row;
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
        try:
            self._rank_writer: Any = self._open(self.rank_dir)
        except BaseException:  # the caller gets no logger to close: the run folder's writer (and thread) ends here
            if self._writer is not None:
                self._writer.close()
            raise
        self._closed = False

    @property
    def writes(self) -> bool:
        """Whether this process writes the run folder (rank 0 with tensorboard on)."""
        return self._writer is not None

    @staticmethod
    def _open(path: str | None) -> Any:
        if path is None:
            return None
        # Imported here: the import costs time (docs/performance.md, "Start-up costs") that runs without
        # tensorboard should not pay.
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(path)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricLogger.log() after close()")

    def log(self, step: int, scalars: dict[str, float], rank_scalars: dict[str, float] | None = None) -> None:
        """Write the run's ``scalars`` to the run folder and this rank's ``rank_scalars`` to its rank folder, each
        under its tag at ``step`` (nothing where there is no writer); a rank's memory sizes in GiB to the nearest
        MiB, as the run folder's across-rank tags (trainer/memory/ranks.py: bytes of bookkeeping would otherwise
        draw as two levels whose ticks read the same)."""
        self._check_open()
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
        if self._rank_writer is not None:
            for tag, value in (rank_scalars or {}).items():
                self._rank_writer.add_scalar(tag, round(value * 1024) / 1024 if tag in _RANK_SIZES else value, step)

    def log_text(self, step: int, tag: str, markdown: str) -> None:
        """A text (tensorboard renders it as markdown) in the run folder, at ``step``; tensorboard files it under
        ``<tag>/text_summary``."""
        self._check_open()
        if self._writer is not None:
            self._writer.add_text(tag, markdown, step)

    def log_image(self, step: int, tag: str, image_HWC) -> None:
        """An RGB image (a uint8 array, height x width x 3) in the run folder, at ``step`` (the Images tab)."""
        self._check_open()
        if self._writer is not None:
            self._writer.add_image(tag, image_HWC, step, dataformats="HWC")

    def log_run_start(self, config_toml: str, hparams: dict[str, Any], metric_tags: list[str],
                      layout: dict | None = None) -> None:
        """The run's merged config as text (tag ``config``, filed as ``config/text_summary``), its HParams row:
        ``hparams`` (name -> an int, a string, a bool or a float; the dict's order is the columns' order) with the
        scalars ``metric_tags`` as the row's metrics, which ``log_run_end`` writes, and a Custom Scalars ``layout``
        (charts that draw several tags). In a run folder of a tb folder, the tb folder's HParams columns are
        declared again with this run's (``write_hparams_config``)."""
        if self._writer is None:
            return
        # tensorboard renders text as markdown: a fenced block keeps the TOML as it is
        self._writer.add_text("config", f"```toml\n{config_toml}```", 0)
        if layout:
            self._writer.add_custom_scalars(layout)
        # the session's group names the row in the table's Trial ID column: the run folder's name
        info = _hparams_pb().plugin_data_pb2.SessionStartInfo(group_name=os.path.basename(self.log_dir),
                                                              start_time_secs=time.time())
        _fill_row(info.hparams, hparams)
        self._writer.file_writer.add_summary(_hparams_summary("_hparams_/session_start_info",
                                                              _plugin_data(session_start_info=info)))
        self._writer.flush()
        if _RUN_ID.match(os.path.basename(os.path.abspath(self.log_dir))):
            write_hparams_config(os.path.dirname(os.path.abspath(self.log_dir)), metric_tags)

    def log_run_end(self, step: int, metrics: dict[str, float]) -> None:
        """The HParams row's metrics (measured over the run), at the run's last step, and the session's end."""
        if self._writer is None:
            return
        pb = _hparams_pb()
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, step)
        end = _plugin_data(session_end_info=pb.plugin_data_pb2.SessionEndInfo(
            status=pb.api_pb2.STATUS_SUCCESS, end_time_secs=time.time()))
        self._writer.file_writer.add_summary(_hparams_summary("_hparams_/session_end_info", end))

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
        ``step    3  loss  7.1234  grad_norm   1.234  tok/s    12,345  mem 0.12/0.34 GiB  lr 8.0e-04``;
        ``tokens_per_s`` is the job's (every data-parallel rank's tokens).

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


def read_texts(log_dir: str, tag: str) -> list[tuple[int, str]]:
    """The texts a run folder holds under ``tag`` (``MetricLogger.log_text``), as ``[(step, markdown), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # slow, tools only

    accumulator = EventAccumulator(log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    name = f"{tag}/text_summary"
    if name not in accumulator.Tags()["tensors"]:
        return []
    return [(event.step, event.tensor_proto.string_val[0].decode()) for event in accumulator.Tensors(name)]


def read_hparams(log_dir: str) -> dict[str, float | str | bool]:
    """The HParams row a run folder's events hold (``MetricLogger.log_run_start``), empty without one: column name
    (its display name) -> value, integers as ints. For tools and tests."""
    row = _session_start(log_dir)
    return {} if row is None else {_display_name(name): _typed(value) for name, value in row.items()}


def write_hparams_config(tb_folder: str, metric_tags: list[str]) -> str:
    """Declare the HParams table's columns for every run of ``tb_folder`` in ``tb_folder/hparams_config/``, replacing
    the earlier declaration; returns that folder.

    One column per HParams name the runs' rows hold (``MetricLogger.log_run_start``): strings and integers with
    their values as a discrete domain (checkboxes), booleans as booleans, floats with their range; ``differs`` when
    the runs hold more than one value, which tensorboard shows first; ``metric_tags``, the row's metrics.
    """
    pb = _hparams_pb()
    columns: dict[str, list] = {}
    for run in run_dirs(tb_folder):
        for name, value in (_session_start(run) or {}).items():
            values = columns.setdefault(name, [])
            if value not in values:
                values.append(value)
    experiment = pb.api_pb2.Experiment(time_created_secs=time.time())
    for name in sorted(columns):
        experiment.hparam_infos.append(_column(pb, name, columns[name]))
    for tag in metric_tags:
        experiment.metric_infos.add().name.tag = tag
    folder = os.path.join(tb_folder, HPARAMS_CONFIG_DIR)
    os.makedirs(folder, exist_ok=True)
    earlier = [os.path.join(folder, f) for f in os.listdir(folder) if "tfevents" in f]
    from torch.utils.tensorboard import SummaryWriter  # slow: only when a run writes tensorboard

    with SummaryWriter(folder) as writer:
        writer.file_writer.add_summary(_hparams_summary("_hparams_/experiment", _plugin_data(experiment=experiment)))
    for path in earlier:  # the new declaration replaces them (tensorboard would pick one of several at random)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return folder


def _column(pb, name: str, values: list):
    """The ``HParamInfo`` of column ``name`` holding ``values`` (protobuf ``Value``s)."""
    info = pb.api_pb2.HParamInfo(name=name, display_name=_display_name(name), differs=len(values) > 1)
    kinds = {value.WhichOneof("kind") for value in values}
    if kinds == {"bool_value"}:
        info.type = pb.api_pb2.DATA_TYPE_BOOL
        for flag in sorted({value.bool_value for value in values}):
            info.domain_discrete.values.add().bool_value = flag
    elif kinds == {"number_value"}:
        info.type = pb.api_pb2.DATA_TYPE_FLOAT64
        info.domain_interval.min_value = min(value.number_value for value in values)
        info.domain_interval.max_value = max(value.number_value for value in values)
    else:  # strings, integers as their digits; a column whose kind changed between runs shows them as text
        info.type = pb.api_pb2.DATA_TYPE_STRING
        texts = {str(_typed(value)) for value in values}
        for text in sorted(texts, key=lambda t: (not t.isdigit(), int(t) if t.isdigit() else 0, t)):
            info.domain_discrete.values.add().string_value = text
    return info


def _hparams_pb() -> SimpleNamespace:
    """tensorboard's HParams protobufs (a slow import: only runs that write tensorboard, and tools, pay it)."""
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    return SimpleNamespace(summary_pb2=summary_pb2, api_pb2=api_pb2, metadata=metadata,
                           plugin_data_pb2=plugin_data_pb2)


def _plugin_data(**fields):
    return _hparams_pb().plugin_data_pb2.HParamsPluginData(version=0, **fields)


def _hparams_summary(tag: str, data):
    """A summary holding HParams plugin ``data`` under ``tag`` (what tensorboard's hparams plugin reads)."""
    pb = _hparams_pb()
    value = pb.summary_pb2.Summary.Value(tag=tag, metadata=pb.metadata.create_summary_metadata(data),
                                         tensor=pb.metadata.NULL_TENSOR)
    return pb.summary_pb2.Summary(value=[value])


def _fill_row(row, hparams: dict[str, Any]) -> None:
    """Fill a SessionStartInfo's map ``row`` with ``hparams``: names with their position (``00_layout``), integers
    as strings of their digits."""
    for position, (name, value) in enumerate(hparams.items()):
        key = f"{position:02d}_{name}"
        if isinstance(value, bool):
            row[key].bool_value = value
        elif isinstance(value, int):
            row[key].string_value = str(value)
        elif isinstance(value, float):
            row[key].number_value = value
        else:
            row[key].string_value = str(value)


def _session_start(run_dir: str) -> dict | None:
    """The HParams row (name -> protobuf ``Value``) in the event files directly in ``run_dir``: it is among the
    first events a run writes, so only those are read."""
    pb = _hparams_pb()
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # slow, tensorboard only

    files = sorted(f for f in os.listdir(run_dir) if "tfevents" in f) if os.path.isdir(run_dir) else []
    for name in files:
        for event in itertools.islice(EventFileLoader(os.path.join(run_dir, name)).Load(), _FIRST_EVENTS):
            for value in event.summary.value:
                if value.tag == pb.metadata.SESSION_START_INFO_TAG:
                    data = pb.plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    return dict(data.session_start_info.hparams)
    return None


_FIRST_EVENTS = 50
"""Events read from the start of a run's event file to find its HParams row (the run writes it among its first)."""


def _display_name(name: str) -> str:
    match = _POSITION.match(name)
    return match.group(1) if match else name


def _typed(value) -> float | str | bool | int:
    """A protobuf ``Value`` of an HParams row as Python: a string of digits as the integer it stands for."""
    kind = value.WhichOneof("kind")
    result = getattr(value, kind) if kind else None
    return int(result) if isinstance(result, str) and result.isdigit() else result


def layout_label(dims) -> str:
    """A layout in a few characters, e.g. ``fsdp4.ep2``, ``pp2.hsdp2x2.ep2``, ``cp2`` or ``1rank``: the pipeline
    stages, the data-parallel replicas x shards (``fsdp`` without replicas, ``ddp`` without shards), then context and
    expert parallelism."""
    parts = [f"pp{dims.pp}"] if dims.pp > 1 else []
    if dims.dp_replicate > 1:
        parts.append(f"hsdp{dims.dp_replicate}x{dims.dp_shard}" if dims.dp_shard > 1 else f"ddp{dims.dp_replicate}")
    elif dims.dp_shard > 1:
        parts.append(f"fsdp{dims.dp_shard}")
    parts += [f"cp{dims.cp}"] if dims.cp > 1 else []
    parts += [f"ep{dims.ep}"] if dims.ep > 1 else []
    return ".".join(parts) or "1rank"


def run_label(text: str) -> str:
    """``text`` as a run folder's label: characters a path and tensorboard's run filter take, at most
    ``LABEL_MAX`` of them."""
    return _LABEL_CHARS.sub("_", text).strip("_")[:LABEL_MAX]


def new_run_dir(tb_folder: str, now: datetime | None = None, label: str = "") -> str:
    """Create and return a new run folder ``tb_folder/[<label>-]<start time>``; ``now`` (UTC) defaults to the current
    time, ``label`` (``run_label``) says what the run set, first, so that runs are told apart by the start of their
    names in tensorboard's run list and HParams table.

    The folder is claimed with ``os.mkdir``, so two runs starting in the same second get two folders
    (``<time>`` and ``<time>_2``). Call it in one process of a run and hand the path to the others.
    """
    stamp = (now or datetime.now(timezone.utc)).strftime(RUN_ID_FORMAT)
    prefix = f"{run_label(label)}-" if run_label(label) else ""
    os.makedirs(tb_folder, exist_ok=True)
    for n in itertools.count(1):
        path = os.path.join(tb_folder, prefix + (stamp if n == 1 else f"{stamp}_{n}"))
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
            runs.append((match.group(2), int(match.group(3) or 1), name))
    return [os.path.join(tb_folder, name) for *_, name in sorted(runs)]
