"""A distributed process and the gloo groups torch never frees: how it ends (`trainer.device.end_process`), and
several jobs in one process reusing their meshes (`parallelisms.mesh.build_meshes`).

torch keeps a gloo process group (and its worker threads) alive after `destroy_process_group` once a functional
collective ran on it, and the interpreter's teardown then races those threads (SIGABRT after a finished run, seen in
tests/test_deepep.py). `end_process` skips that teardown; what it must not lose is output or the exit code. A new
mesh per job would add those threads at every job. This file is also the torchrun worker
(`python tests/test_process_exit.py CODE` or `... jobs`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gloo_threads() -> int:
    """This process's gloo worker threads (their names as the kernel reports them)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def test_without_a_process_group_it_is_a_plain_exit():
    from trainer import device as devices

    with pytest.raises(SystemExit) as exit_info:
        devices.end_process(4)
    assert exit_info.value.code == 4


def _launch(nproc: int, code: int | str, **env: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), str(code)]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", **env), capture_output=True,
                       text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_a_distributed_process_ends_with_its_code_and_its_output():
    rc, out = _launch(2, 0)
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        assert f"printed by rank {rank}" in out and f"logged by rank {rank}" in out, out[-3000:]
        # why end_process exists; when torch frees the group, this fails and the workaround can go
        assert f"rank {rank}: gloo threads after destroy_process_group: 0" not in out, out[-3000:]
        # a rank names itself after its group is gone (its line after a peer died): rank 1 stays rank 1
        assert f"rank {rank}: rank() after destroy_process_group: {rank}" in out, out[-3000:]
    # one rank: a failing code is not lost (with two, torchrun stops the other rank when one fails)
    rc, out = _launch(1, 3)
    assert rc != 0 and "exitcode  : 3" in out and "printed by rank 0" in out, out[-3000:]  # torchrun's report


def _worker(code: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from trainer import device as devices

    devices.init_distributed(timeout_s=60)
    rank = dist.get_rank()
    # what DTensor does for a gradient norm or a redistribution
    total = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    assert total.tolist() == [float(dist.get_world_size())] * 2
    del total
    devices.shutdown_distributed()
    print(f"rank {rank}: gloo threads after destroy_process_group: {_gloo_threads()}")
    print(f"rank {rank}: rank() after destroy_process_group: {devices.rank()}")
    print(f"printed by rank {rank}", end="")  # no newline: only an explicit flush writes it
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("end_process").info("logged by rank %d", rank)
    devices.end_process(code)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_jobs_in_one_process_reuse_their_layouts_groups(tmp_path):
    """Three trainers in one launch: fsdp2 x ep2, fsdp2, fsdp2 x ep2 again. The third builds no group: its layout's
    meshes are the first's, and each trainer's preemption-flag group is destroyed at its close. Before, the third
    job added 4 groups and 12 gloo threads per rank. A closed trainer leaves the groups at the timeout of a new
    group: the next job's first compile runs under it, as in a new process.

    A fourth trainer fails at the end of its start, with tensorboard, preemption signals and the heartbeat open:
    it closes them itself (the caller gets no trainer to close), leaving the same groups, threads and handlers."""
    rc, out = _launch(2, "jobs", JOBS_DIR=str(tmp_path))
    assert rc == 0, out[-3000:]
    for rank in (0, 1):
        counts = (tmp_path / f"counts_{rank}").read_text().splitlines()  # "groups G, gloo threads T, ..." per job
        assert len(counts) == 4, out[-3000:]
        assert counts[3] == counts[2] == counts[1], counts
        assert counts[1] != counts[0], counts  # the second layout did build its own: the count is not blind
        # handed on as new groups: torch's default, not the 115 s train timeout (100 s + 15) the job ended with
        assert all(line.endswith(", timeouts 0:30:00") for line in counts), counts


def _let_trainer_threads_end(seconds: float = 10.0) -> None:
    """Wait up to `seconds` for the trainer's own threads to end: a close joins them with a timeout, which a loaded
    machine can outlast; one that never ends is still counted."""
    import threading
    import time

    names = ("heartbeat", "watchdog", "preemption-signals")
    deadline = time.monotonic() + seconds
    while any(t.name in names for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _jobs_worker() -> None:
    import signal
    import threading

    import torch
    import torch.distributed as dist
    from small_models import SMALL, hf_config_file

    from trainer import device as devices
    from trainer.job_config import load_config
    from trainer.train import Trainer, run

    def fail_at_the_end_of_the_start(trainer: Trainer) -> None:
        raise RuntimeError("injected at the end of Trainer.__init__")

    devices.init_distributed(timeout_s=60)
    rank = dist.get_rank()
    base = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", hf_config_file(SMALL),
            "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", "1",
            "--validation.enable", "false", "--memory.track", "off", "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "false"]
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    folder = os.environ["JOBS_DIR"]
    # tensorboard on, and the train timeout set in __init__ (init_timeout_steps 0): close must reset it
    failing = ep2 + ["--metrics.enable_tensorboard", "true", "--comm.init_timeout_steps", "0"]
    for i, extra in enumerate([ep2, [], ep2, failing]):
        args = load_config(base + ["--job.dump_folder", os.path.join(folder, str(i))] + extra)
        if extra is failing:
            Trainer._announce_compile = fail_at_the_end_of_the_start
            try:
                run(args, shutdown=False)
                raise AssertionError("the injected failure did not happen")
            except RuntimeError as e:
                assert "injected" in str(e), e
        else:
            run(args, shutdown=False)
        dist.barrier()
        _let_trainer_threads_end()
        groups = [g for g in dist.distributed_c10d._world.pg_names if g is not dist.group.WORLD]
        timeouts = sorted({str(g._get_backend(torch.device("cpu")).options._timeout) for g in groups})
        handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
        with open(os.path.join(folder, f"counts_{rank}"), "a") as f:  # a file per rank: stdout interleaves them
            f.write(f"groups {len(groups)}, gloo threads {_gloo_threads()}, threads {threading.active_count()}, "
                    f"handlers {handlers}, timeouts {' '.join(timeouts)}\n")
    devices.shutdown_distributed()
    devices.end_process(0)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    if sys.argv[1] == "jobs":
        _jobs_worker()
    else:
        _worker(int(sys.argv[1]))
