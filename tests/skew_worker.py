"""Train jobs whose router is biased towards some experts (skewed routing), in one launch of ranks, and write rank
0's per-step scalars (memory across ranks, routing statistics) as JSON.

Usage: `tests/dist_utils.launch_json`, or torchrun --nproc_per_node N tests/skew_worker.py jobs.json results.json
jobs.json: {"name": {"args": [config args...], "favoured_experts": [expert ids], "bias": float}, ...}. The bias is
added to `expert_bias` (the selection-only score offset) of every MoE layer after the model is built; with
`moe.load_balance_coeff 0` it stays, so every token picks its top-k among the favoured experts when they are enough.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from tests.dist_worker import worker_session  # noqa: E402
from trainer import device as devices  # noqa: E402
from trainer.job_config import load_config  # noqa: E402
from trainer.prepare import prepare  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def main(jobs_path: str, out_path: str) -> None:
    with worker_session(jobs_path, out_path) as (jobs, results):
        for name, spec in jobs.items():
            prep = prepare(load_config(spec["args"]), dist.get_world_size(), dist.get_rank())
            trainer = Trainer(prep, devices.local_device())
            for part in trainer.model_parts:
                for moe in part.moe_layers():
                    moe.expert_bias[spec["favoured_experts"]] += spec["bias"]
            history: list[dict] = []
            try:
                trainer.train(history)
            finally:
                trainer.close()
            results[name] = [{k: v for k, v in h.items() if k.startswith(("memory/", "moe/")) or k == "loss"}
                             for h in history]
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
