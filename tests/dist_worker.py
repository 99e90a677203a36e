"""Run several training jobs in one launch of ranks (one process group) and write rank 0's scalars as JSON.

Usage: `tests/dist_utils.launch_json` (ranks forked from a fork server), or
    torchrun --nproc_per_node N tests/dist_worker.py jobs.json results.json
jobs.json: {"name": [config args...] or {"args": [...], "stop_after": k}, ...}. With stop_after the job is
interrupted after step k (as if Ctrl-C hit step k + 1), to test resuming. Launching costs seconds on 2 cores, so
tests group jobs per launch.
"""

import contextlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer import device as devices  # noqa: E402
from trainer.job_config import load_config  # noqa: E402
from trainer.train import Trainer, run  # noqa: E402


class _Stop(Exception):
    pass


def _run_job(spec, history):
    args, stop_after = (spec, None) if isinstance(spec, list) else (spec["args"], spec.get("stop_after"))
    if stop_after is None:
        run(load_config(args), shutdown=False, history=history)
        return
    original = Trainer.train_step

    def stopping(self, step):
        if step > stop_after:
            raise _Stop
        return original(self, step)

    Trainer.train_step = stopping
    try:
        run(load_config(args), shutdown=False, history=history)
    except _Stop:
        pass
    finally:
        Trainer.train_step = original


KEYS = ("loss", "grad_norm", "validation/loss")


@contextlib.contextmanager
def worker_session(jobs_path: str, out_path: str, timeout_s: float = 120):
    """Inside a rank (torchrun's or `dist_utils.launch_json`'s): join the process group, load the jobs, yield (jobs,
    results); whatever happens, rank 0 writes `results` as JSON, the process group is destroyed and the process ends
    (`devices.end_process`: exit 0, or 1 after printing the traceback). Nothing after the `with` block runs."""
    torch.set_num_threads(1)
    devices.init_distributed(timeout_s=timeout_s)
    with open(jobs_path) as f:
        jobs = json.load(f)
    results: dict = {}
    code = 1
    try:
        yield jobs, results
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        devices.shutdown_distributed()
        devices.end_process(code)


def main(jobs_path: str, out_path: str) -> None:
    with worker_session(jobs_path, out_path) as (jobs, results):
        for name, args in jobs.items():
            history = []
            _run_job(args, history)
            results[name] = [{k: v for k, v in h.items() if k in KEYS} for h in history]
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
