"""`python -m trainer.plot_memory`: reads every rank's memory scalars of one run, re-runs the leak detector, writes
a PNG."""

import struct
import subprocess
import sys

import pytest

from trainer.memory.leak_detector import SLOPE_TAG
from trainer.metrics import MetricLogger
from trainer.tools.plot_memory import ALLOCATED, PEAK, RSS, find_run, load_runs, render

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GiB_PER_MiB = 1 / 1024


RUN = "20250101-120000"


def write_run(dump, ranks, leaking_rank=None, steps=40, all_ranks=True, log_slope=False, run=RUN, base=2.0):
    """Scalars like the train loop's in ``dump/tb/<run>``: ``base`` GiB at step end, a noisy peak, RSS above; one
    rank leaks 1 MiB/step."""
    for rank in ranks:
        logger = MetricLogger(str(dump / "tb" / run), rank, enable_tensorboard=True, save_for_all_ranks=all_ranks)
        for step in range(1, steps + 1):
            allocated = base + (step * GiB_PER_MiB if rank == leaking_rank and step > 10 else 0.0)
            scalars = {ALLOCATED: allocated, PEAK: allocated + 1.0 + 0.01 * (step % 3), RSS: allocated + 0.5}
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
    runs = load_runs(find_run(str(tmp_path)))
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
    run_dir = tmp_path / "tb" / RUN
    assert result.stdout.splitlines() == [f"run {run_dir}", "rank 0: no leak (largest slope 0 MiB/step)",
                                          f"wrote {run_dir / 'memory.png'}"]
    assert png_size(run_dir / "memory.png") == (1200, 1000)


def test_latest_run_by_default_never_mixed_and_any_run_by_choice(tmp_path):
    # an older run of 40 steps that leaks, then a newer 2-rank run at another level: read together, the curves
    # jump back from step 40 to step 1 (the "no leak (largest slope 4.971 MiB/step)")
    write_run(tmp_path, ranks=[0], leaking_rank=0, all_ranks=False, run="20250101-120000")
    write_run(tmp_path, ranks=[0, 1], steps=30, run="20250101-120000_2", base=1.5)
    latest = tmp_path / "tb" / "20250101-120000_2"
    for path in (tmp_path, tmp_path / "tb", latest):
        assert find_run(str(path)) == str(latest)
    runs = load_runs(str(latest))
    assert [r.rank for r in runs] == [0, 1]
    assert [r.series[ALLOCATED][0] for r in runs] == [list(range(1, 31))] * 2
    assert [r.summary() for r in runs] == [f"rank {r}: no leak (largest slope 0 MiB/step)" for r in (0, 1)]
    older = load_runs(find_run(str(tmp_path), run="20250101-120000"))
    assert len(older) == 1 and older[0].alarm.slope_MiB_per_step == pytest.approx(1.0, rel=1e-3)
    result = subprocess.run([sys.executable, "-m", "trainer.plot_memory", str(tmp_path / "tb"), "--run", "nope"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"no run nope under {tmp_path / 'tb'} (runs: 20250101-120000, 20250101-120000_2)")


def test_run_without_tensor_memory_gets_no_verdict(tmp_path):
    logger = MetricLogger(str(tmp_path / "tb" / RUN), 0, enable_tensorboard=True, save_for_all_ranks=False)
    for step in range(1, 21):
        logger.log(step, {RSS: 1.0})
    logger.close()
    [run] = load_runs(find_run(str(tmp_path)))
    assert run.verdicts == [] and run.summary() == (
        "rank 0: no tensor memory logged (memory tracking was off), no leak verdict")


def test_cli_without_event_files_fails_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.plot_memory", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"no tensorboard runs in {tmp_path}: expected a dump folder (with "
                                     "tb/<run id>/), its tb folder or a run folder")
