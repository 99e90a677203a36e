"""Memory across ranks: one small gather per step gives rank 0 a few numbers of every rank, so that rank 0's
tensorboard, console line and summary show the spread and name the rank that needs the most memory.

Rank 0 is rarely that rank: the first pipeline stage holds the most activations, and the EP rank of a hot expert
receives the most rows. Each rank contributes one row of `FIELDS` (NaN where it measured nothing); rank 0 turns the
rows into, for each field, `<tag>/max`, `/min` and `/median` scalars (`TAGS`: `memory/<field>`, and
`moe/live_handles` for the MoE comm backend's handles alive at step end), plus the same under `<tag>/stage_<s>/` per
pipeline stage when PP > 1, and one text per logging step naming the rank holding each max (`WORST_RANK_TAG`): a
rank number is no curve (tensorboard's smoothing would draw rank 2.5), so it is not a scalar. The cost is one
gather of `len(FIELDS) + 1` doubles per rank and step (measured in docs/memory.md, "Memory across ranks").

Memory is logged in GiB to the nearest MiB: the exact tracker and the allocator count bytes, and a few hundred
bytes of bookkeeping (a step counter, a rank's RNG state) would otherwise draw as a jump between two levels whose
axis ticks all read the same. The leak detector reads the exact bytes.

Where a rank sits follows from the world mesh's layout, `(pp, dp_replicate, efsdp, ep)` with pp outermost
(`parallelisms/mesh.py`): its stage is `rank // (world / pp)` and its EP rank `rank % ep`.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.memory.leak_detector import LeakVerdict
from trainer.memory.monitor import MemoryStats
from trainer.metrics import read_texts

__all__ = ["FIELDS", "HANDLES_TAG", "TAGS", "WORST_RANK_TAG", "CrossRankMemory", "RankTable", "memory_layout",
           "memory_values", "place_of", "read_worst_ranks"]

FIELDS = ("peak_allocated_GiB", "allocated_GiB", "reserved_GiB", "rss_GiB", "device_share_pct",
          "leak_slope_MiB_per_step", "live_handles")
"""The per-rank numbers gathered each step: the peak within the step and the tensor memory at its end, the CUDA
caching allocator's reserved bytes or the process RSS, the step's peak as a share of the device's memory (CUDA),
the leak detector's slope once its window is full, and the MoE comm backend's handles alive at step end (a backend
that reports `HANDLES_TAG`)."""
HANDLES_TAG = "moe/live_handles"
"""The comm backend's metric of handles alive at step end (parallelisms/moe_comm), gathered as `live_handles`."""
TAGS = {field: f"memory/{field}" for field in FIELDS} | {"live_handles": HANDLES_TAG}
"""Each field's tag in the run folder (its spread: `<tag>/max`, `/min`, `/median`)."""
WORST_RANK_TAG = "worst_rank"
"""The run folder's text tag naming, at each logging step, the rank holding each field's max (the Text tab)."""
_CUDA_ONLY = ("reserved_GiB", "device_share_pct")
_ALARM = len(FIELDS)  # the last column: the leak alarms a rank raised at this step, as `ALARMS` bits
ALARMS = {"memory": 1, "handles": 2}
"""The bit of each leak detector (tensor memory, live handles) in a rank's alarm column."""
_WORST_ROW = re.compile(r"^\| (\S+) \| [^|]* \| rank (\d+)\b")


def place_of(rank: int, world_size: int, pp: int, ep: int) -> str:
    """`rank 5 (stage 1, EP rank 1 of 4)`: a rank with where it sits in the layout (only what the layout has)."""
    where = []
    if pp > 1:
        where.append(f"stage {rank // (world_size // pp)}")
    if ep > 1:
        where.append(f"EP rank {rank % ep} of {ep}")
    return f"rank {rank}" + (f" ({', '.join(where)})" if where else "")


def _top(values: dict[int, float]) -> int:
    """The rank with the largest value; the lowest such rank on a tie."""
    return max(values, key=lambda r: (values[r], -r))


@dataclass(frozen=True)
class RankTable:
    """Every rank's row of one step (rank 0 only): `rows[r][i]` is field `FIELDS[i]` of rank r (NaN: not measured)."""

    rows: list[list[float]]
    pp: int
    ep: int

    @property
    def world_size(self) -> int:
        return len(self.rows)

    def column(self, field: str, ranks: range | None = None) -> dict[int, float]:
        """Rank -> value of `field`, for the ranks that measured it."""
        i = FIELDS.index(field)
        return {r: self.rows[r][i] for r in (ranks or range(self.world_size)) if not math.isnan(self.rows[r][i])}

    def worst(self, field: str) -> tuple[int, float] | None:
        """(rank, value) of the largest value of `field` (the lowest such rank), or None where no rank measured it."""
        values = self.column(field)
        if not values:
            return None
        rank = _top(values)
        return rank, values[rank]

    def place(self, rank: int) -> str:
        """`rank` with its stage and EP rank (`place_of`)."""
        return place_of(rank, self.world_size, self.pp, self.ep)

    def alarms(self, kind: str = "memory") -> list[int]:
        """The ranks whose leak detector of `kind` (`ALARMS`) raised its alarm at this step."""
        return [r for r, row in enumerate(self.rows) if int(row[_ALARM]) & ALARMS[kind]]

    def _groups(self) -> list[tuple[str, range]]:
        """The whole job, then each pipeline stage (PP > 1): (tag suffix, its ranks)."""
        per_stage = self.world_size // self.pp
        groups = [("", range(self.world_size))]
        if self.pp > 1:
            groups += [(f"/stage_{s}", range(s * per_stage, (s + 1) * per_stage)) for s in range(self.pp)]
        return groups

    def scalars(self) -> dict[str, float]:
        """The tensorboard scalars of the spread (see the module docstring); nothing for an unmeasured field."""
        scalars: dict[str, float] = {}
        for field in FIELDS:
            for suffix, ranks in self._groups():
                values = self.column(field, ranks)
                if values:
                    tag = f"{TAGS[field]}{suffix}"
                    scalars.update({f"{tag}/max": max(values.values()), f"{tag}/min": min(values.values()),
                                    f"{tag}/median": statistics.median(values.values())})
        return scalars

    def worst_rank_text(self) -> str:
        """A markdown table naming, for each measured field (and pipeline stage), the rank holding its max, with
        its place in the layout, beside the max, median and min (`WORST_RANK_TAG`; `read_worst_ranks` reads it)."""
        lines = ["| field | max | on | median | min |", "|---|---:|---|---:|---:|"]
        for field in FIELDS:
            for suffix, ranks in self._groups():
                values = self.column(field, ranks)
                if values:
                    rank = _top(values)
                    lines.append(f"| {TAGS[field]}{suffix} | {values[rank]:.4g} | {self.place(rank)} | "
                                 f"{statistics.median(values.values()):.4g} | {min(values.values()):.4g} |")
        return "\n".join(lines)


def read_worst_ranks(run_dir: str) -> dict[str, list[tuple[int, int]]]:
    """The rank holding each field's max at each logging step, from a run folder's `WORST_RANK_TAG` texts:
    `{tag: [(step, rank), ...]}` (tags as in `TAGS`, with `/stage_<s>` per pipeline stage)."""
    ranks: dict[str, list[tuple[int, int]]] = {}
    for step, text in read_texts(run_dir, WORST_RANK_TAG):
        for line in text.splitlines():
            match = _WORST_ROW.match(line)
            if match:
                ranks.setdefault(match.group(1), []).append((step, int(match.group(2))))
    return ranks


def memory_layout(pp: int, cuda: bool, live_handles: bool = False) -> dict:
    """Tensorboard's Custom Scalars layout of the spread: one chart per field (and per stage) with its max, median
    and min as three lines of every run, so a field reads as a band instead of three charts; off CUDA, none for the
    fields only CUDA measures; the live handles' only with a comm backend that reports them."""
    charts = {}
    stages = [f"/stage_{s}" for s in range(pp)] if pp > 1 else []
    for field in FIELDS:
        if (not cuda and field in _CUDA_ONLY) or (field == "live_handles" and not live_handles):
            continue
        for suffix in ["", *stages]:
            tag = f"{TAGS[field]}{suffix}"
            charts[f"{field}{suffix.replace('/', ' ')}"] = ["Multiline", [f"^{tag}/(max|median|min)$"]]
    return {"memory across ranks": charts}


class CrossRankMemory:
    """Gathers each rank's row to rank 0 (no collective in a single process).

    group: the process group of every rank (None: a single process). The rows are host values (allocator counters,
    the exact tracker's, RSS, handle counts), so their tensors live on the CPU and the gather runs on the group's
    host backend (gloo, beside NCCL on CUDA: `trainer/device.py`): it never waits for the device.
    """

    def __init__(self, group, rank: int, world_size: int, pp: int, ep: int) -> None:
        self.group, self.rank = group, rank
        self.world_size, self.pp, self.ep = world_size, pp, ep
        # the buffers every step reuses: this rank's row, and on rank 0 one row per rank
        self._mine = torch.empty(len(FIELDS) + 1, dtype=torch.float64)
        self._table = torch.empty(world_size, len(FIELDS) + 1, dtype=torch.float64) \
            if rank == 0 and group is not None else None

    def gather(self, values: dict[str, float | None], alarms: tuple[str, ...] = ()) -> RankTable | None:
        """This rank's `values` (by field of `FIELDS`; missing or None: not measured) and the kinds of leak alarm
        (`ALARMS`) its detectors raised at this step, gathered; the table on rank 0, None on the others."""
        row = [math.nan if values.get(f) is None else float(values[f]) for f in FIELDS]
        row.append(float(sum(ALARMS[kind] for kind in set(alarms))))
        if self.group is None:
            return RankTable([row], self.pp, self.ep)
        self._mine.copy_(torch.tensor(row, dtype=torch.float64))
        rows = list(self._table.unbind(0)) if self._table is not None else None
        dist.gather(self._mine, rows, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return RankTable(self._table.tolist(), self.pp, self.ep)


def memory_values(stats: MemoryStats, verdict: LeakVerdict | None, device_bytes: int | None,
                  live_handles: float | None = None) -> dict[str, float | None]:
    """This rank's row of `FIELDS` from its step's `MemoryStats`, its leak detector's verdict (None before the
    window is full), the device's memory (None off CUDA) and the comm backend's live handles (None: not reported);
    memory in GiB to the nearest MiB (the module docstring)."""
    peak = stats.peak_bytes
    return {"peak_allocated_GiB": _gib(peak), "allocated_GiB": _gib(stats.allocated_bytes),
            "reserved_GiB": _gib(stats.reserved_bytes), "rss_GiB": _gib(stats.rss_bytes),
            "device_share_pct": round(100 * peak / device_bytes, 2) if peak is not None and device_bytes else None,
            "leak_slope_MiB_per_step": verdict.slope_MiB_per_step if verdict is not None else None,
            "live_handles": live_handles}


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20) / 1024
