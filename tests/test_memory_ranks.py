"""Memory across ranks (trainer/memory/ranks.py): rank 0 gathers a few numbers of every rank each step and logs
their spread and the rank holding the most (a text: a rank is no curve); the console, the leak alarm and the
end-of-run line name that rank."""

import math
import os
import re
import sys

import pytest
from dist_utils import run_cli

from trainer.memory.monitor import MemoryStats
from trainer.memory.ranks import FIELDS, WORST_RANK_TAG, RankTable, memory_values, place_of, read_worst_ranks

NAN = math.nan


def _row(peak, allocated, rss, slope=NAN, alarm=0.0, handles=NAN):
    values = {"peak_allocated_GiB": peak, "allocated_GiB": allocated, "rss_GiB": rss,
              "leak_slope_MiB_per_step": slope, "live_handles": handles}
    return [values.get(field, NAN) for field in FIELDS] + [alarm]


def test_the_spread_names_the_rank_with_the_most_and_splits_by_stage(tmp_path):
    # 4 ranks, 2 pipeline stages, EP 2: rank 2 (stage 1) has the largest peak, rank 1 the most at step end and the
    # most live handles; rank 1 raised a memory alarm, rank 3 a handle alarm
    table = RankTable([_row(3.0, 1.0, 5.0, handles=0), _row(2.0, 1.5, 5.0, alarm=1.0, handles=6),
                       _row(4.0, 1.0, 6.0, handles=0), _row(1.0, 0.5, 5.0, alarm=2.0, handles=2)], pp=2, ep=2)
    scalars = table.scalars()
    assert scalars["memory/peak_allocated_GiB/max"] == 4.0 and scalars["memory/peak_allocated_GiB/min"] == 1.0
    assert scalars["memory/peak_allocated_GiB/median"] == 2.5 and scalars["memory/peak_allocated_GiB/stage_0/max"] == 3
    assert scalars["moe/live_handles/max"] == 6 and scalars["moe/live_handles/stage_1/max"] == 2
    # no rank as a scalar (smoothing would draw fractional ranks); a field no rank measured has no tag
    assert not [tag for tag in scalars if "rank" in tag or tag.startswith(("memory/reserved", "memory/leak_slope"))]
    assert table.worst("peak_allocated_GiB") == (2, 4.0) and table.worst("reserved_GiB") is None
    assert table.alarms() == [1] and table.alarms("handles") == [3]
    assert table.place(2) == "rank 2 (stage 1, EP rank 0 of 2)"
    assert place_of(5, 8, 1, 4) == "rank 5 (EP rank 1 of 4)" and place_of(3, 4, 1, 1) == "rank 3"
    # the text names the rank holding each max, with its place; a tie goes to the lowest rank
    text = table.worst_rank_text()
    assert "| memory/peak_allocated_GiB | 4 | rank 2 (stage 1, EP rank 0 of 2) | 2.5 | 1 |" in text.splitlines()
    assert "| memory/rss_GiB/stage_0 | 5 | rank 0 (stage 0, EP rank 0 of 2) | 5 | 5 |" in text.splitlines()
    assert "| moe/live_handles | 6 | rank 1 (stage 0, EP rank 1 of 2) | 1 | 0 |" in text.splitlines()
    from trainer.metrics import MetricLogger

    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    for step in (5, 10):
        metrics.log_text(step, WORST_RANK_TAG, text)
    metrics.close()
    worst = read_worst_ranks(str(tmp_path))
    assert worst["memory/peak_allocated_GiB"] == [(5, 2), (10, 2)]
    assert worst["memory/allocated_GiB/stage_0"] == [(5, 1), (10, 1)] and worst["moe/live_handles"][0] == (5, 1)


def test_memory_is_logged_to_the_nearest_MiB():
    """A few hundred bytes of bookkeeping never draw as a change (issue 36: 288 bytes read as a jump)."""
    GiB, MiB = 2**30, 2**20
    before = memory_values(MemoryStats(allocated_bytes=101 * MiB + 40, peak_bytes=3 * GiB), None, None, 0)
    after = memory_values(MemoryStats(allocated_bytes=101 * MiB + 328, peak_bytes=3 * GiB + 2 * MiB), None, None, 0)
    assert before["allocated_GiB"] == after["allocated_GiB"] == 101 / 1024
    assert after["peak_allocated_GiB"] - before["peak_allocated_GiB"] == 2 / 1024  # a MiB counts
    assert before["rss_GiB"] is None and before["live_handles"] == 0


@pytest.mark.slow
def test_a_rank_made_to_grow_is_named_wherever_memory_is_reported(tmp_path):
    """4 ranks (PP 2 x FSDP 2), rank 3 (stage 1) keeps 1 MiB more after every batch it reads (a module patched in
    at interpreter start, not a trainer hook): rank 0's tensorboard names it as the rank with the most memory at step
    end, of its stage and of the job, and logs its leak alarm with its rank; its own warning names its stage; the
    memory plot's verdicts name it, in two lines for four ranks. About 40 s on 2 cores."""
    from test_errors_after_launch import LEAKY_RANK, REPO, run_train

    from trainer.memory.leak_detector import ALARM_RANK_TAG, ALARM_TAG
    from trainer.metrics import read_hparams, read_scalars, run_dirs

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(LEAKY_RANK)
    result = run_train(tmp_path, "--training.steps", "8", "--model.n_layers", "2", "--memory.track", "exact",
                       "--memory.leak_warmup_steps", "1", "--memory.leak_window", "3", "--memory.dump_on_leak", "false",
                       "--metrics.enable_tensorboard", "true", "--metrics.save_for_all_ranks", "true",
                       "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
                       ngpu=4, LEAK_RANK="3", PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), REPO]))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = run_dirs(str(tmp_path / "dump" / "tb"))[-1]
    run = read_scalars(run_dir)
    assert read_hparams(run_dir)["world_size"] == 4
    worst = read_worst_ranks(run_dir)  # at the logging steps (1, 5, 8) and the alarm's (4)
    late = [rank for step, rank in worst["memory/allocated_GiB"] if step >= 3]
    assert late and set(late) == {3}, worst["memory/allocated_GiB"]
    assert {rank for step, rank in worst["memory/allocated_GiB/stage_1"] if step >= 3} == {3}
    assert run[ALARM_TAG] == [(4, 1.0)] and run[ALARM_RANK_TAG] == [(4, 3.0)]
    assert re.search(r"\[rank 3\] .* rank 3 \(stage 1\): memory leak: memory allocated at step end grows 1 MiB/step",
                     result.stderr), result.stderr[-3000:]
    summary = [line for line in result.stderr.splitlines() if "run done: " in line][-1]
    assert re.search(r"peak tensor memory \d+\.\d\d GiB on rank \d \(stage \d\),", summary), summary
    plot = run_cli("trainer.plot_memory", [str(tmp_path / "dump"), "--warmup", "1", "--window", "3"], timeout=120)
    assert plot.returncode == 0, plot.stderr
    verdicts = plot.stdout.splitlines()[1:-1]
    assert len(verdicts) == 2 and verdicts[0].startswith("rank 3: memory leak: ") and \
        verdicts[1].startswith("ranks 0-2 (3): no leak"), verdicts


def test_gather_benchmark_smoke(capsys):
    """benchmarks/rank_gather.py in one process: one JSON line with the times it measured."""
    import json

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import rank_gather

    rank_gather.main(["--smoke"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ranks"] == 1 and report["calls"] == 20 and report["bytes_per_rank"] == 8 * (len(FIELDS) + 1)
    assert 0 < report["median_us"] <= report["p90_us"] <= report["max_us"]
