"""What the per-step gather of memory across ranks costs (`trainer.memory.ranks.CrossRankMemory.gather`).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=8 benchmarks/rank_gather.py
    python benchmarks/rank_gather.py --smoke          # one process (no collective): what the tests run

Every rank times `--calls` gathers of its row (one per step in training) after `--warmup` untimed ones, each from
a barrier to the gather's return on rank 0. Rank 0 prints one JSON object: ranks, backend, the median, p90 and max
microseconds of a gather, and the bytes each rank sends. Compare the median with the step time of the same layout
(the trainer's console line) to see its share of a step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from trainer.memory.ranks import FIELDS, CrossRankMemory

    smoke = "--smoke" in argv
    calls = 20 if smoke else int(argv[argv.index("--calls") + 1]) if "--calls" in argv else 200
    warmup = 2 if smoke else 10
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    gather = CrossRankMemory(dist.group.WORLD if distributed else None, rank, world, 1, 1)
    values = {field: float(rank) for field in FIELDS}
    times = []
    for i in range(warmup + calls):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        gather.gather(values)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        us = sorted(t * 1e6 for t in times)
        print(json.dumps({"ranks": world, "backend": dist.get_backend() if distributed else None, "calls": calls,
                          "median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * len(us))], 1),
                          "max_us": round(us[-1], 1), "bytes_per_rank": 8 * (len(FIELDS) + 1)}))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
