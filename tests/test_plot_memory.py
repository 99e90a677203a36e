"""`python -m trainer.plot_memory`: reads one run's memory (rank 0's spread over the ranks, and every rank's own curves
where the run saved them), re-runs the leak detector, writes a PNG that stays readable at any rank count."""

import struct

import pytest
from dist_utils import run_cli

from trainer.memory.leak_detector import SLOPE_TAG
from trainer.memory.ranks import WORST_RANK_TAG, RankTable
from trainer.metrics import MetricLogger
from trainer.tools.plot_memory import (ALLOCATED, MAX_RANK_LINES, MAX_VERDICT_LINES, PEAK, RSS, find_run,
                                      load_run, render)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GiB_PER_MiB = 1 / 1024


RUN = "20250101-120000"


def _own(rank, step, leaking_rank, base):
    allocated = base + (step * GiB_PER_MiB if rank == leaking_rank and step > 10 else 0.0) + 0.01 * rank
    return {ALLOCATED: allocated, PEAK: allocated + 1.0 + 0.01 * (step % 3), RSS: allocated + 0.5}


def write_run(dump, ranks, leaking_rank=None, steps=40, all_ranks=True, log_slope=False, run=RUN, base=2.0, pp=1):
    """Scalars like the train loop's in ``dump/tb/<run>``: rank 0's spread over ``ranks`` (with pipeline stages),
    and with ``all_ranks`` each rank's own: ``base`` GiB at step end, a noisy peak, RSS above; one rank leaks
    1 MiB/step."""
    world = len(ranks)
    loggers = {r: MetricLogger(str(dump / "tb" / run), r, enable_tensorboard=True, save_for_all_ranks=all_ranks)
               for r in ranks}
    loggers[0].log_run_start("", {"world_size": world, "pp": pp}, [])
    for step in range(1, steps + 1):
        rows = []
        for rank in ranks:
            own = _own(rank, step, leaking_rank, base)
            if log_slope:
                own[SLOPE_TAG] = 0.0
            rows.append([own[PEAK], own[ALLOCATED], float("nan"), own[RSS], float("nan"),
                         own.get(SLOPE_TAG, float("nan")), float("nan"), 0.0])
            loggers[rank].log(step, {}, own)
        table = RankTable(rows, pp, 1)
        loggers[0].log(step, table.scalars())
        loggers[0].log_text(step, WORST_RANK_TAG, table.worst_rank_text())
    for logger in loggers.values():
        logger.close()


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_all_ranks_rendered_with_the_leaking_rank_flagged(tmp_path):
    write_run(tmp_path, ranks=[0, 1, 2], leaking_rank=1)
    run = load_run(find_run(str(tmp_path)))
    runs = run.ranks
    assert [r.rank for r in runs] == [0, 1, 2]
    assert [r.alarm is not None for r in runs] == [False, True, False]
    # growth starts after step 10; the window must first fill with growing points
    assert runs[1].alarm.slope_MiB_per_step == pytest.approx(1.0, rel=1e-3)
    lines = run.verdict_lines()
    assert lines[0].startswith("rank 1: memory leak: ")
    assert lines[1:] == ["ranks 0, 2 (2): no leak (largest slope 0 MiB/step, rank 0)"]
    out = tmp_path / "memory.png"
    render(run, str(out))
    assert png_size(out) == (1400, 1000)


def test_many_ranks_are_bands_with_a_bounded_legend_and_bounded_verdicts(tmp_path):
    """64 ranks over 2 pipeline stages, every rank's curves saved, one leaking: the figure holds one band per
    stage and the worst rank, not 64 lines; the verdicts are one line for the leak and one for the 63 others."""
    import matplotlib

    matplotlib.use("Agg")
    write_run(tmp_path, ranks=list(range(64)), leaking_rank=37, steps=30, pp=2)
    run = load_run(find_run(str(tmp_path)))
    assert len(run.ranks) == 64 and run.world_size == 64 and run.pp == 2
    assert set(run.spread[PEAK]) == {"max", "min", "median", "max_rank"}
    assert {f"{PEAK}/stage_{s}" for s in (0, 1)} <= set(run.spread)
    lines = run.verdict_lines()
    assert len(lines) == 2 and lines[0].startswith("rank 37: memory leak: ")
    assert lines[1].startswith("ranks 0-36, 38-63 (63): no leak")
    assert run.worst_rank() == 63  # 0.01 GiB more per rank in this synthetic run; the leak adds 30 MiB by step 30
    out = tmp_path / "memory.png"
    fig = _figure_of(run, out)
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert len(labels) <= 12, labels  # bands per stage and the worst rank, not a line per rank
    assert "rank 63 (largest peak)" in labels and "rank 37 (recomputed)" in labels  # the leaking rank's slope
    assert not any(f"rank {r} " in " ".join(labels) for r in (1, 2, 62))
    texts = [t.get_text() for t in fig.texts]
    assert sum(len(t.splitlines()) for t in texts) <= 1 + MAX_VERDICT_LINES
    assert png_size(out) == (1400, 1000)


def test_a_run_without_rank_folders_reads_its_spread(tmp_path):
    """Without metrics.save_for_all_ranks only rank 0's spread exists: bands and a verdict from the largest slope."""
    write_run(tmp_path, ranks=list(range(16)), all_ranks=False, log_slope=True, steps=12)
    run = load_run(find_run(str(tmp_path)))
    assert run.ranks == [] and run.world_size == 16
    assert run.verdict_lines() == ["16 ranks: no leak alarm (largest slope 0 MiB/step, rank 0 at step 1)"]
    assert run.worst_rank() == 15  # rank 15 holds 0.15 GiB more in this synthetic run
    render(run, str(tmp_path / "m.png"))
    assert MAX_RANK_LINES == 8


def test_cli_on_a_single_process_run(tmp_path):
    write_run(tmp_path, ranks=[0], all_ranks=False, log_slope=True)
    result = run_cli("trainer.plot_memory", [str(tmp_path), "--threshold-MiB", "0.5"], timeout=120)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "tb" / RUN
    assert result.stdout.splitlines() == [f"run {run_dir}", "rank 0: no leak (largest slope 0 MiB/step)",
                                          f"wrote {run_dir / 'memory.png'}"]
    assert png_size(run_dir / "memory.png") == (1400, 1000)


def test_latest_run_by_default_never_mixed_and_any_run_by_choice(tmp_path):
    # an older run of 40 steps that leaks, then a newer 2-rank run at another level: read together, the curves
    # jump back from step 40 to step 1 (the "no leak (largest slope 4.971 MiB/step)")
    write_run(tmp_path, ranks=[0], leaking_rank=0, all_ranks=False, run="20250101-120000")
    write_run(tmp_path, ranks=[0, 1], steps=30, run="20250101-120000_2", base=1.5)
    latest = tmp_path / "tb" / "20250101-120000_2"
    for path in (tmp_path, tmp_path / "tb", latest):
        assert find_run(str(path)) == str(latest)
    runs = load_run(str(latest)).ranks
    assert [r.rank for r in runs] == [0, 1]
    assert [r.series[ALLOCATED][0] for r in runs] == [list(range(1, 31))] * 2
    assert [r.summary() for r in runs] == [f"rank {r}: no leak (largest slope 0 MiB/step)" for r in (0, 1)]
    older = load_run(find_run(str(tmp_path), run="20250101-120000")).ranks
    assert len(older) == 1 and older[0].alarm.slope_MiB_per_step == pytest.approx(1.0, rel=1e-3)
    result = run_cli("trainer.plot_memory", [str(tmp_path / "tb"), "--run", "nope"], timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"no run nope under {tmp_path / 'tb'} (runs: 20250101-120000, 20250101-120000_2)")


def test_run_without_tensor_memory_gets_no_verdict(tmp_path):
    logger = MetricLogger(str(tmp_path / "tb" / RUN), 0, enable_tensorboard=True, save_for_all_ranks=False)
    logger.log_run_start("", {"world_size": 1, "pp": 1}, [])
    for step in range(1, 21):
        logger.log(step, RankTable([[float("nan")] * 3 + [1.0] + [float("nan")] * 3], 1, 1).scalars())
    logger.close()
    [run] = load_run(find_run(str(tmp_path))).ranks
    assert run.verdicts == [] and run.summary() == (
        "rank 0: no tensor memory logged (memory tracking was off), no leak verdict")


def test_cli_without_event_files_fails_with_one_line(tmp_path):
    result = run_cli("trainer.plot_memory", [str(tmp_path)], timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"no tensorboard runs in {tmp_path}: expected a dump folder (with "
                                     "tb/<run id>/), its tb folder or a run folder")


def _figure_of(run, out):
    """The matplotlib figure `render` draws for `run` (its savefig intercepted)."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig
    Figure.savefig = lambda fig, path, **kw: (figures.append(fig), save(fig, path, **kw))[-1]
    try:
        render(run, str(out))
    finally:
        Figure.savefig = save
    [fig] = figures
    return fig


@pytest.mark.parametrize("ranks", [[0], [0, 1], list(range(12))], ids=["one process", "2 ranks", "12 ranks (bands)"])
def test_a_run_of_one_step_draws_markers_not_empty_panels(tmp_path, ranks):
    """A 1-step run (a smoke test, a run that failed at step 2) has one point per series: a line through one point
    draws nothing, so every series with few points is drawn with markers; long series stay plain lines."""
    write_run(tmp_path, ranks=ranks, steps=1, log_slope=True)
    fig = _figure_of(load_run(find_run(str(tmp_path))), tmp_path / "memory.png")
    drawn = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
    assert len(drawn) >= 3, [ax.get_lines() for ax in fig.axes]  # tensor memory, RSS, slope
    assert all(line.get_marker() not in (None, "None", "", " ") for line in drawn), \
        [(line.get_label(), line.get_marker()) for line in drawn]
    write_run(tmp_path, ranks=[0, 1], steps=40, run="20250101-130000")
    fig = _figure_of(load_run(find_run(str(tmp_path))), tmp_path / "long.png")
    long = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 40]
    assert long and all(line.get_marker() in (None, "None", "", " ") for line in long)
