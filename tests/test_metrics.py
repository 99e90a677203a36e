"""Tests of MetricLogger (tensorboard round trip, per-rank folders, texts and images, the HParams columns, console
line, close), run folder names and init_logging, and the experts' load heatmap (trainer/expert_load.py)."""

import logging
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from trainer.metrics import MetricLogger, init_logging, layout_label, new_run_dir, read_scalars, run_dirs

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


def test_a_ranks_memory_sizes_are_written_to_the_nearest_mib(tmp_path):
    """288 bytes of bookkeeping between two steps (issue 36) draw no step in a rank's memory chart; other values
    and breakdowns are written as given."""
    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=True)
    base = 0.0942 * 2**30
    for step, nbytes in ((1, base), (2, base + 288)):
        metrics.log(step, {}, {"memory/allocated_GiB": nbytes / 2**30, "memory/breakdown/activations_GiB": 557 / 2**30,
                               "moe/live_handles": 3.0})
    metrics.close()
    scalars = read_scalars(str(tmp_path / "rank_0"))
    [(_, first), (_, second)] = scalars["memory/allocated_GiB"]
    assert first == second == pytest.approx(round(base / 2**20) / 1024)
    assert scalars["memory/breakdown/activations_GiB"][0][1] == pytest.approx(557 / 2**30)
    assert scalars["moe/live_handles"] == [(1, 3.0), (2, 3.0)]


def test_config_text_and_hparams_row_round_trip(tmp_path):
    """The run's merged config as text and its HParams row (settings, then the metrics at the end) read back
    from the event files; only rank 0 writes them."""
    from trainer.metrics import read_hparams

    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    metrics.log_run_start("[training]\nsteps = 3\n", {"ac_mode": "selective", "ep": 2, "compile": False},
                          ["run/peak_memory_GiB"])
    metrics.log_run_end(3, {"run/peak_memory_GiB": 1.5})
    metrics.close()
    # integers come back as integers, booleans as booleans (not 2.0 and 0.0)
    hparams = read_hparams(str(tmp_path))
    assert hparams == {"ac_mode": "selective", "ep": 2, "compile": False} and type(hparams["ep"]) is int
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


def test_a_run_folder_starts_with_what_the_run_set(tmp_path):
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    first = new_run_dir(str(tmp_path), when, label="ac=selective,fsdp4.ep2,bf16")
    second = new_run_dir(str(tmp_path), when, label="ac=selective,fsdp4.ep2,bf16")
    odd = new_run_dir(str(tmp_path), when, label="my run / ablation #3 - v2")
    later = new_run_dir(str(tmp_path), when.replace(second=6), label="ac=full,fsdp4.ep2,bf16")
    assert [Path(p).name for p in (first, second, odd, later)] == [
        "ac=selective,fsdp4.ep2,bf16-20250102-030405", "ac=selective,fsdp4.ep2,bf16-20250102-030405_2",
        "my_run_ablation_3_-_v2-20250102-030405", "ac=full,fsdp4.ep2,bf16-20250102-030406"]
    (tmp_path / "hparams_config").mkdir()  # the HParams declaration: not a run
    assert run_dirs(str(tmp_path)) == [first, odd, second, later]  # by start time, whatever the labels


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


# ------------------------------------------------------------------------------------------------ run names


def _dims(pp=1, dp_replicate=1, dp_shard=1, cp=1, ep=1):
    from parallelisms.parallel_dims import ParallelDims

    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, pp=pp, cp=cp,
                        world_size=pp * dp_replicate * dp_shard * cp)


def test_layout_label_names_each_degree_in_a_few_characters():
    assert layout_label(_dims()) == "1rank"
    assert layout_label(_dims(dp_shard=4, ep=2)) == "fsdp4.ep2"
    assert layout_label(_dims(pp=2, dp_replicate=2, dp_shard=2, ep=2)) == "pp2.hsdp2x2.ep2"
    assert layout_label(_dims(dp_replicate=2)) == "ddp2"
    assert layout_label(_dims(pp=2, cp=2)) == "pp2.cp2"


def test_a_run_name_always_holds_the_ac_mode_layout_and_dtype_and_puts_incidental_settings_last():
    from trainer.job_config import LABEL_MAX, load_config, run_name, validate_job

    def name(world, *argv):
        cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", *argv])
        return run_name(cfg, validate_job(cfg, world))

    # the default AC mode is named too: a reader does not spot the AC-none run by what is missing
    assert name(1) == "ac=none,1rank,fp32"
    ep = ("--parallelism.expert_parallel_degree", "2", "--training.steps", "8", "--metrics.log_freq", "1")
    assert name(4, *ep, "--training.dtype", "bfloat16") == "ac=none,fsdp4.ep2,bf16,steps=8,log_freq=1"
    assert name(4, *ep, "--activation_checkpoint.mode", "selective", "--activation_checkpoint.save_ops",
                "mm,grouped_mm") == "ac=selective,save_ops=mm+grouped_mm,fsdp4.ep2,fp32,steps=8,log_freq=1"
    # what else the command line set comes first, so that the start of the name says what differs (long keys short)
    assert name(4, *ep, "--parallelism.expert_parallel_comm_backend", "deepep", "--training.dtype", "bfloat16") == \
        "comm=deepep,ac=none,fsdp4.ep2,bf16,steps=8,log_freq=1"
    assert name(1, "--training.steps", "8", "--optimizer.lr", "1e-3") == "lr=0.001,ac=none,1rank,fp32,steps=8"
    # too long: incidental settings are counted first, then the others from the end; the three parts stay
    many = name(1, "--model.n_layers", "3", "--training.local_batch_size", "2", "--training.seq_len", "128",
                "--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0.01", "--training.steps", "8",
                "--metrics.log_freq", "1", "--training.seed", "3")
    assert len(many) <= LABEL_MAX and many.endswith(",ac=none,1rank,fp32,+4"), many
    assert many.startswith("n_layers=3,local_batch_size=2,seq_len=128,lr=0.001,"), many
    # a description given on the command line replaces the keys, cut so that the three parts still fit
    long = name(1, "--job.description", "ablation " * 20)
    assert len(long) <= LABEL_MAX and long.startswith("ablation ablation") and long.endswith(",ac=none,1rank,fp32")


# ------------------------------------------------------------------------------------------------ HParams


def _hparams_config(tb):
    """The HParams declaration tensorboard would read for the tb folder: the experiment in hparams_config/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    folder = tb / "hparams_config"
    assert len([f for f in folder.iterdir() if "tfevents" in f.name]) == 1  # one declaration, the latest
    events = EventAccumulator(str(folder))
    events.Reload()
    content = events.PluginTagToContent("hparams")[metadata.EXPERIMENT_TAG]
    return plugin_data_pb2.HParamsPluginData.FromString(content).experiment


def test_the_hparams_columns_are_declared_for_every_run_of_the_tb_folder(tmp_path):
    """Each run's start declares the columns again from every run folder's row: in the row's order (a position in
    the name, the display name without it), what differs marked so, integers as strings of their digits with their
    values as checkboxes, booleans as booleans; the Trial ID is the run folder's name."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    from trainer.metrics import read_hparams

    tb = tmp_path / "tb"
    when = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    runs = []
    for i, mode in enumerate(("none", "full")):
        run = new_run_dir(str(tb), when.replace(second=i), label=f"ac={mode},fsdp2.ep2,fp32")
        metrics = MetricLogger(run, rank=0, enable_tensorboard=True, save_for_all_ranks=False)
        metrics.log_run_start("", {"layout": "fsdp2.ep2", "ac_mode": mode, "world_size": 2 + 14 * i,
                                   "compile": False, "lr": 0.001 * (i + 1)}, ["run/peak_memory_GiB"])
        metrics.close()
        runs.append(run)
    experiment = _hparams_config(tb)
    infos = {info.display_name: info for info in experiment.hparam_infos}
    assert [info.name for info in experiment.hparam_infos] == ["00_layout", "01_ac_mode", "02_world_size",
                                                              "03_compile", "04_lr"]
    assert list(infos) == ["layout", "ac_mode", "world_size", "compile", "lr"]
    assert {name for name, info in infos.items() if info.differs} == {"ac_mode", "world_size", "lr"}
    assert [v.string_value for v in infos["world_size"].domain_discrete.values] == ["2", "16"]  # numeric order
    assert infos["world_size"].type == api_pb2.DATA_TYPE_STRING
    assert infos["compile"].type == api_pb2.DATA_TYPE_BOOL
    assert [v.bool_value for v in infos["compile"].domain_discrete.values] == [False]
    assert infos["lr"].type == api_pb2.DATA_TYPE_FLOAT64 and infos["lr"].domain_interval.max_value == 0.002
    assert [m.name.tag for m in experiment.metric_infos] == ["run/peak_memory_GiB"]
    assert [read_hparams(r)["world_size"] for r in runs] == [2, 16]
    for run in runs:  # the row's group, the table's Trial ID: the run folder's name
        events = EventAccumulator(run)
        events.Reload()
        content = events.PluginTagToContent("hparams")[metadata.SESSION_START_INFO_TAG]
        assert plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.group_name == Path(run).name


def test_texts_and_images_round_trip(tmp_path):
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.metrics import read_texts

    metrics = MetricLogger(str(tmp_path), rank=0, enable_tensorboard=True, save_for_all_ranks=False)
    metrics.log_text(4, "worst_rank", "| a | b |")
    metrics.log_image(4, "moe/tokens_per_expert", np.zeros((3, 5, 3), dtype=np.uint8))
    metrics.close()
    assert read_texts(str(tmp_path), "worst_rank") == [(4, "| a | b |")] and read_texts(str(tmp_path), "x") == []
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    [image] = events.Images("moe/tokens_per_expert")
    assert (image.step, image.width, image.height) == (4, 5, 3)


# ------------------------------------------------------------------------------------------------ experts' load


def test_the_heatmap_colours_are_a_fixed_scale_around_the_mean():
    """Independent reference: blue at 0, white at the mean, red at twice the mean and beyond, linear between."""
    import numpy as np

    from trainer.expert_load import SCALE_MAX, colours

    assert SCALE_MAX == 2.0
    got = colours(np.array([0.0, 0.5, 1.0, 1.5, 2.0, 7.0]))
    blue, white, red = np.array([33, 102, 172]), np.array([247, 247, 247]), np.array([178, 24, 43])
    want = [blue, (blue + white) / 2, white, (white + red) / 2, red, red]
    assert np.abs(got.astype(float) - np.array(want)).max() <= 0.5


def test_the_heatmap_has_a_row_per_layer_a_column_per_expert_and_parts_the_ep_ranks():
    import numpy as np

    from trainer.expert_load import colours, expert_load_image, rows_of

    values = {"moe/layer_3/tokens_per_expert": [10.0, 30.0, 20.0, 20.0], "loss": 1.0,
              "moe/layer_1/tokens_per_expert": [20.0, 20.0, 0.0, 40.0]}
    rows = rows_of(values)
    assert list(rows) == [1, 3]
    image = expert_load_image(rows, ep=2)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    # the cells: find the top-left cell by its colour (layer 1, expert 0: the mean, white), then walk the grid
    white = colours(np.array([1.0]))[0]
    ys, xs = np.nonzero((image == white).all(axis=2))
    top, left = ys.min(), xs.min()
    cell_w, cell_h = 32, 24  # the largest cells: 4 experts and 2 layers
    for row, counts in enumerate(rows.values()):
        load = np.array(counts) / np.mean(counts)
        for expert in range(4):
            y, x = top + row * cell_h + cell_h // 2, left + expert * cell_w + cell_w // 2
            assert (image[y, x] == colours(load[expert:expert + 1])[0]).all(), (row, expert)
    # one dark line between EP rank 0's experts (0, 1) and rank 1's (2, 3)
    line = image[top + 1, left + 2 * cell_w - 1]
    assert (line == [40, 40, 40]).all() and not (image[top + 1, left + cell_w - 1] == [40, 40, 40]).all()


def test_only_the_last_pending_step_reads_its_rows_and_in_the_same_transfer():
    import torch

    from trainer import step_scalars
    from trainer.step_scalars import PendingSteps, StepRecord

    pending = PendingSteps()
    for step in (1, 2):
        pending.add(StepRecord(step, {"loss": torch.tensor(float(step)), "moe/layer_1/tokens_per_expert":
                                      torch.tensor([step, 2 * step])}))
    assert pending.last_step == 2
    reads = step_scalars.host_reads()
    first, last = pending.flush(arrays=True)
    assert step_scalars.host_reads() == reads + 1
    assert first.scalars == {"loss": 1.0} and last.scalars == {"loss": 2.0, "moe/layer_1/tokens_per_expert": [2.0, 4.0]}
    pending.add(StepRecord(3, {"loss": torch.tensor(3.0), "moe/layer_1/tokens_per_expert": torch.tensor([1, 1])}))
    [only] = pending.flush()
    assert only.scalars == {"loss": 3.0} and pending.last_step is None
