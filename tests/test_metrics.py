"""Tests of MetricLogger (tensorboard round trip, per-rank folders, console line, close) and init_logging."""

import logging
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from trainer.metrics import MetricLogger, init_logging, new_run_dir, read_scalars, run_dirs

REPO = Path(__file__).resolve().parents[1]


def test_scalars_round_trip(tmp_path):
    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    for step in range(1, 4):
        metrics.log(step, {"loss/train": 10.0 / step, "lr": 1e-3})
    metrics.close()
    scalars = read_scalars(str(tmp_path))
    assert set(scalars) == {"loss/train", "lr"}
    assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3]
    assert [v for _, v in scalars["loss/train"]] == pytest.approx([10.0, 5.0, 10.0 / 3])
    assert scalars["lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3)), (3, pytest.approx(1e-3))]


def test_only_rank_0_writes_by_default(tmp_path):
    other = MetricLogger(str(tmp_path), rank=1, enable_tensorboard=True, save_for_all_ranks=False)
    other.log(1, {"loss/train": 1.0})
    other.close()
    assert other.log_dir is None and not any(tmp_path.iterdir())


def test_save_for_all_ranks_writes_per_rank_folders(tmp_path):
    """Rank 0 writes the run's scalars to the run folder; with save_for_all_ranks every rank also writes its own
    scalars to rank_<r>/, and only those."""
    for rank in (0, 1):
        metrics = MetricLogger(str(tmp_path), rank=rank, enable_tensorboard=True, save_for_all_ranks=True)
        metrics.log(5, {"loss": 2.0}, {"memory/allocated_GiB": float(rank)})
        metrics.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["rank_0", "rank_1"]
    assert read_scalars(str(tmp_path)) == {"loss": [(5, 2.0)]}
    for rank in (0, 1):
        assert read_scalars(str(tmp_path / f"rank_{rank}")) == {"memory/allocated_GiB": [(5, float(rank))]}


def test_config_text_and_hparams_row_round_trip(tmp_path):
    """The run's merged config as text and its HParams row (settings, then the metrics at the end) read back
    from the event files; only rank 0 writes them."""
    from trainer.metrics import read_hparams

    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    metrics.log_run_start("[training]\nsteps = 3\n", {"ac_mode": "selective", "ep": 2, "compile": False},
                          ["run/peak_memory_GiB"])
    metrics.log_run_end(3, {"run/peak_memory_GiB": 1.5})
    metrics.close()
    assert read_hparams(str(tmp_path)) == {"ac_mode": "selective", "ep": 2.0, "compile": False}
    assert read_scalars(str(tmp_path)) == {"run/peak_memory_GiB": [(3, 1.5)]}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    [text] = events.Tensors("config/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "```toml\n[training]\nsteps = 3\n```"
    other = MetricLogger(str(tmp_path / "other"), rank=1, enable_tensorboard=True, save_for_all_ranks=False)
    other.log_run_start("x", {"ep": 2}, [])
    other.close()
    assert not (tmp_path / "other").exists()


def test_a_run_folder_is_labelled_by_what_the_run_set(tmp_path):
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    first = new_run_dir(str(tmp_path), when, label="mode=selective,expert_parallel_degree=2")
    second = new_run_dir(str(tmp_path), when, label="mode=selective,expert_parallel_degree=2")
    odd = new_run_dir(str(tmp_path), when, label="my run / ablation #3")
    assert [Path(p).name for p in (first, second, odd)] == [
        "20250102-030405-mode=selective,expert_parallel_degree=2",
        "20250102-030405_2-mode=selective,expert_parallel_degree=2", "20250102-030405-my_run_ablation_3"]
    assert run_dirs(str(tmp_path)) == [first, odd, second]


def test_every_run_claims_its_own_folder_and_runs_sort_by_start(tmp_path):
    tb = tmp_path / "tb"
    second = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    same_second = [Path(new_run_dir(str(tb), second)) for _ in range(11)]
    later = Path(new_run_dir(str(tb), second.replace(second=6)))
    assert [p.name for p in same_second] == ["20250102-030405"] + [f"20250102-030405_{n}" for n in range(2, 12)]
    assert all(p.is_dir() and p.parent == tb for p in same_second + [later])
    (tb / "rank_0").mkdir()  # not a run folder
    # start order, numeric within a second (a string sort would put _10 before _2)
    assert run_dirs(str(tb)) == [str(p) for p in same_second + [later]]
    assert run_dirs(str(tmp_path / "missing")) == []


def test_disabled_tensorboard_writes_nothing(tmp_path):
    for log_dir in (str(tmp_path), None):
        metrics = MetricLogger(log_dir, rank=0, enable_tensorboard=log_dir is None, save_for_all_ranks=True)
        metrics.log(1, {"loss/train": 1.0})
        metrics.close()
    assert not any(tmp_path.iterdir())


def test_close_is_idempotent_and_log_after_close_is_an_error(tmp_path):
    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    metrics.log(1, {"loss/train": 1.0})
    metrics.close()
    metrics.close()
    with pytest.raises(RuntimeError, match="after close"):
        metrics.log(2, {"loss/train": 1.0})
    assert read_scalars(str(tmp_path)) == {"loss/train": [(1, 1.0)]}


def test_console_line_on_rank_0_only(caplog):
    caplog.set_level(logging.INFO, logger="trainer.metrics")
    args = dict(
        loss=7.12345, grad_norm=1.2345, tokens_per_s=12345.6, mem_current_GiB=0.123, mem_peak_GiB=0.339, lr=8e-4
    )
    MetricLogger(None, rank=1, enable_tensorboard=False, save_for_all_ranks=False).console(3, **args)
    assert caplog.messages == []
    rank0 = MetricLogger(None, rank=0, enable_tensorboard=False, save_for_all_ranks=False)
    rank0.console(3, **args, extra={"moe/max_load": 1.23456, "skipped": 2})
    rank0.console(1000, **{**args, "loss": 10.5})
    first, second = caplog.messages
    assert first == (
        "step    3  loss  7.1235  grad_norm   1.234  tok/s    12,346  mem 0.12/0.34 GiB  lr 8.0e-04"
        "  moe/max_load 1.235  skipped 2"
    )
    # Fixed widths keep the columns aligned from line to line.
    assert first.index("grad_norm") == second.index("grad_norm") and first.index("lr") == second.index("lr")


def test_console_shows_rss_when_tensor_memory_was_not_measured(caplog):
    caplog.set_level(logging.INFO, logger="trainer.metrics")
    rank0 = MetricLogger(None, rank=0, enable_tensorboard=False, save_for_all_ranks=False)
    args = dict(loss=7.0, grad_norm=1.0, tokens_per_s=100.0, mem_current_GiB=None, mem_peak_GiB=None, lr=1e-3)
    rank0.console(1, **args, rss_GiB=1.234)
    rank0.console(2, **args)
    assert caplog.messages == [
        "step    1  loss  7.0000  grad_norm   1.000  tok/s       100  rss 1.23 GiB  lr 1.0e-03",
        "step    2  loss  7.0000  grad_norm   1.000  tok/s       100  lr 1.0e-03",
    ]


def test_tensorboard_import_is_lazy():
    # A fresh interpreter, since other tests of this session import tensorboard.
    code = (
        "import sys; from trainer.metrics import MetricLogger; "
        "MetricLogger(None, rank=0, enable_tensorboard=True, save_for_all_ranks=False); "
        "MetricLogger('unused', rank=0, enable_tensorboard=False, save_for_all_ranks=False); "
        "print(sorted(m for m in sys.modules if m.startswith(('tensorboard', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_init_logging_levels_and_prefix(capsys):
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    try:
        init_logging(rank=1)
        init_logging(rank=1)  # a second call replaces, not duplicates, the handler
        logging.getLogger("trainer.test").info("hidden on rank 1")
        logging.getLogger("trainer.test").warning("careful")
        init_logging(rank=0)
        logging.getLogger("trainer.test").info("progress")
        lines = capsys.readouterr().err.splitlines()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert len(lines) == 2
    assert lines[0].startswith("[rank 1] ") and lines[0].endswith("WARNING careful")
    assert not lines[1].startswith("[rank") and lines[1].endswith("INFO progress")
