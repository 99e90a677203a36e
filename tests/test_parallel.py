"""Loss parity of every parallelism combination against one process, on gloo CPU ranks (fp32).

Each launch runs several jobs (tests/dist_worker.py) because a multi-process launch costs seconds on 2 cores.
"""

import json
import os
import subprocess
import sys

import pytest

from trainer.config import load_config
from trainer.train import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# global batch of 4 sequences of 32 tokens; same data order whatever the layout
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.local_batch_size", "1", "--training.steps", "3",
        "--validation.enable", "false", "--memory.track", "off", "--metrics.enable_tensorboard", "false",
        "--training.deterministic", "true", "--model.flavor", "debugmodel"]


def launch(nproc: int, jobs: dict, tmp_path) -> dict:
    jobs = {name: BASE + ["--job.dump_folder", str(tmp_path / name)] + args for name, args in jobs.items()}
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "tests", "dist_worker.py"), str(jobs_file), str(out_file)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    return json.loads(out_file.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return run(load_config(BASE + ["--job.dump_folder", str(tmp), "--training.local_batch_size", "4"]))


def _assert_parity(results, reference, rel=2e-5):
    for name, losses in results.items():
        assert losses == pytest.approx(reference, rel=rel), (name, losses, reference)


@pytest.mark.slow
def test_two_ranks_fsdp_and_ep(tmp_path, reference):
    results = launch(2, {
        "fsdp2": [],
        "fsdp2_ep2": ["--parallelism.expert_parallel_degree", "2"],
        "fsdp2_ep2_accum": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    }, tmp_path)
    _assert_parity(results, reference)


@pytest.mark.slow
def test_four_ranks_hsdp_and_ep(tmp_path, reference):
    results = launch(4, {
        "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
        "fsdp4_ep2": ["--parallelism.expert_parallel_degree", "2"],
        "fsdp4_ep4": ["--parallelism.expert_parallel_degree", "4"],
        "hsdp2x2_ep2": ["--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.expert_parallel_degree", "2"],
    }, tmp_path)
    _assert_parity(results, reference)
