"""`python -m trainer.plot_memory`: reads every rank's memory scalars, re-runs the leak detector, writes a PNG."""

import struct
import subprocess
import sys

import pytest

from trainer.leak_detector import SLOPE_TAG
from trainer.metrics import MetricLogger
from trainer.plot_memory import ALLOCATED, PEAK, RESERVED, load_runs, render

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GiB_PER_MiB = 1 / 1024


def write_run(dump, ranks, leaking_rank=None, steps=40, all_ranks=True, log_slope=False):
    """Scalars like the train loop's: 2 GiB at step end, a noisy peak, RSS above; one rank leaks 1 MiB/step."""
    for rank in ranks:
        logger = MetricLogger(str(dump / "tb"), rank, enable_tensorboard=True, save_for_all_ranks=all_ranks)
        for step in range(1, steps + 1):
            allocated = 2.0 + (step * GiB_PER_MiB if rank == leaking_rank and step > 10 else 0.0)
            scalars = {ALLOCATED: allocated, PEAK: allocated + 1.0 + 0.01 * (step % 3), RESERVED: allocated + 0.5}
            if log_slope:
                scalars[SLOPE_TAG] = 0.0
            logger.log(step, scalars)
        logger.close()


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_all_ranks_rendered_with_the_leaking_rank_flagged(tmp_path):
    write_run(tmp_path, ranks=[0, 1, 2], leaking_rank=1)
    runs = load_runs(str(tmp_path))
    assert [r.rank for r in runs] == [0, 1, 2]
    assert [r.alarm is not None for r in runs] == [False, True, False]
    # growth starts after step 10; the window must first fill with growing points
    assert runs[1].alarm.slope_MiB_per_step == pytest.approx(1.0, rel=1e-3)
    assert "no leak (largest slope 0 MiB/step)" in runs[0].summary()
    out = tmp_path / "memory.png"
    render(runs, str(out))
    assert png_size(out) == (1200, 1000)


def test_cli_on_a_rank_zero_only_run(tmp_path):
    write_run(tmp_path, ranks=[0], all_ranks=False, log_slope=True)
    result = subprocess.run([sys.executable, "-m", "trainer.plot_memory", str(tmp_path), "--threshold-MiB", "0.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["rank 0: no leak (largest slope 0 MiB/step)",
                                          f"wrote {tmp_path / 'memory.png'}"]
    assert png_size(tmp_path / "memory.png") == (1200, 1000)


def test_cli_without_event_files_fails_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.plot_memory", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == f"no tensorboard event files under {tmp_path / 'tb'}"
