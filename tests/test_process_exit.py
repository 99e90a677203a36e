"""How a distributed process ends: `trainer.device.end_process`.

torch keeps a gloo process group (and its worker threads) alive after `destroy_process_group` once a functional
collective ran on it, and the interpreter's teardown then races those threads (SIGABRT after a finished run, seen in
tests/test_deepep.py). `end_process` skips that teardown; what it must not lose is output or the exit code. This file
is also the torchrun worker (`python tests/test_process_exit.py CODE`).
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


def _launch(nproc: int, code: int) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), str(code)]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=300)
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


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    _worker(int(sys.argv[1]))
