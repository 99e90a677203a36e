"""Leak detector and memory snapshots.

Synthetic series pin down the algorithm (robust slope, one alarm, level shifts vs. leaks, periodic growth);
then leaks are injected into real training runs of a small DeepSeek-V3 (the debug flavor cut to one dense and
one MoE layer at width 64, so that steps are quick even with exact tracking) and the detector, with its default
window and warm-up, must fire on each, and never on a clean 50-step run with validation.
"""

import json
import logging
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from small_models import TINY, hf_config_file

from trainer.job_config import load_config
from trainer.memory.leak_detector import ALARM_TAG, SLOPE_TAG, LeakDetector, MemoryLeakError, theil_sen_slope
from trainer.memory.monitor import MemoryMonitor
from trainer.memory.snapshots import MemorySnapshots
from trainer.train import Trainer, prepare

KiB, MiB = 1 << 10, 1 << 20
# Defaults: warm-up 5, window 10, alarm after 10 // 2 = 5 steps above the threshold -> the 19th update.
ALARM_STEP = 5 + 10 + 5 - 1
# The test model is tiny, so its injected leaks are a few KiB per step; the default threshold (0.1 MiB/step) is
# meant for real models. 1 KiB/step is still far above the clean run's slope, which is exactly 0.
THRESHOLD_MIB = 1 / 1024


def feed(detector: LeakDetector, values):
    return [detector.update(step, int(v)) for step, v in enumerate(values, start=1)]


# ----------------------------------------------------------------------------------------------------------
# The algorithm on synthetic series


def test_theil_sen_ignores_outliers():
    xs = list(range(10))
    ys = [3.0 * x for x in xs]
    ys[4] += 1e9
    assert theil_sen_slope(xs, ys) == 3.0
    with pytest.raises(ValueError):
        theil_sen_slope([1, 1], [0, 5])


def test_per_step_leak_alarms_once_at_the_predicted_step(caplog):
    detector = LeakDetector()
    with caplog.at_level(logging.WARNING, logger="trainer.memory.leak_detector"):
        verdicts = feed(detector, [100 * MiB + step * MiB for step in range(40)])
    assert verdicts[:14] == [None] * 14  # 5 warm-up steps + 9 steps filling the window
    assert detector.scalars(verdicts[14]) == {SLOPE_TAG: 1.0}
    assert [v.leaking for v in verdicts[14:]] == [False] * 4 + [True] * 22
    assert detector.alarm.step == ALARM_STEP and detector.alarm.first_step == ALARM_STEP - 9
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "grows 1 MiB/step (Theil-Sen slope over steps 10-19; threshold 0.1 MiB/step)" in warnings[0]
    assert detector.scalars(None) == {}
    # the alarm's step is marked once, the later steps carry the slope only
    alarm_index = ALARM_STEP - 1
    assert detector.scalars(verdicts[alarm_index]) == {SLOPE_TAG: 1.0, ALARM_TAG: 1.0}
    assert ALARM_TAG not in detector.scalars(verdicts[alarm_index + 1])


@pytest.mark.parametrize("jump", [1 * MiB, 1 << 30])
def test_level_shifts_and_spikes_are_not_leaks(jump):
    shift = [0 if step < 20 else jump for step in range(60)]
    spikes = [jump if step % 7 == 0 else 0 for step in range(60)]
    two_far_apart = [0 if step < 20 else jump if step < 35 else 2 * jump for step in range(60)]
    for series in (shift, spikes, two_far_apart):
        detector = LeakDetector()
        feed(detector, series)
        assert detector.alarm is None


@pytest.mark.parametrize("period", [2, 3, 5])
def test_growth_every_few_steps_is_a_leak(period):
    # e.g. a cache that grows only in validation, which runs every `period` steps
    detector = LeakDetector()
    feed(detector, [(step // period) * MiB for step in range(40)])
    assert detector.alarm is not None
    assert detector.alarm.slope_per_step == pytest.approx(MiB / period, rel=0.5)


def test_growth_below_threshold_and_noise_are_not_leaks():
    torch.manual_seed(0)
    detector = LeakDetector(threshold_per_step=MiB)
    noise = (torch.randn(60) * 4 * MiB).tolist()
    feed(detector, [step * MiB / 2 + n for step, n in enumerate(noise)])
    assert detector.alarm is None


def test_fail_on_leak_raises_one_line_after_the_callback():
    """`update` records the alarm (so that the caller logs its step first); `check` raises."""
    seen = []
    detector = LeakDetector(fail_on_leak=True, on_leak=seen.append)
    for step in range(1, ALARM_STEP + 1):
        detector.check()  # nothing before the alarm
        detector.update(step, step * 2 * MiB)
    with pytest.raises(MemoryLeakError) as info:
        detector.check()
    message = str(info.value)
    assert "\n" not in message and "grows 2 MiB/step" in message and "memory.fail_on_leak = false" in message
    assert [v.step for v in seen] == [ALARM_STEP]


def test_a_failing_callback_does_not_hide_the_leak(caplog):
    def broken(verdict):
        raise OSError("disk full")

    detector = LeakDetector(on_leak=broken)
    with caplog.at_level(logging.WARNING, logger="trainer.memory.leak_detector"):
        feed(detector, [step * MiB for step in range(30)])
    assert detector.alarm is not None
    assert any("memory leak" in r.getMessage() for r in caplog.records)


def test_message_names_the_category_that_grew():
    detector = LeakDetector()
    for step in range(1, 30):
        detector.update(step, step * MiB, {"parameters": 10 * MiB, "activations": step * MiB})
    assert "mostly activations (+9 MiB over the window)" in detector.alarm.message()


def test_from_config_defaults_and_switches():
    cfg = load_config([])
    detector = LeakDetector.from_config(cfg.memory)
    assert (detector.warmup_steps, detector.window, detector.threshold_per_step) == (5, 10, 0.1 * MiB)
    assert detector.enabled and not detector.fail_on_leak
    for overrides in (["--memory.track", "off"], ["--memory.leak_window", "0"]):
        off = LeakDetector.from_config(load_config(overrides).memory)
        assert feed(off, [step * MiB for step in range(30)]) == [None] * 30 and off.alarm is None
    with pytest.raises(ValueError):
        LeakDetector(window=2)


# ----------------------------------------------------------------------------------------------------------
# Leaks injected into real training runs


def test_the_handle_detector_watches_live_handles_with_memory_untracked(caplog):
    """A MoE comm backend's live handles: 0 at every step end in a healthy run, so a handle a step (one layer's
    dispatch never released) is a leak, named in handles, with its rank; one left once (a shift) is not; it runs
    with memory tracking off (a count is always measured) and stops the run with fail_on_leak."""
    from trainer.memory.leak_detector import HANDLE_THRESHOLD_PER_STEP, HANDLES

    cfg = load_config(["--memory.track", "off", "--memory.fail_on_leak", "true"]).memory
    clean = LeakDetector.for_handles(cfg)
    assert clean.enabled and feed(clean, [0] * 12 + [1] * 28)[-1].slope_per_step == 0 and clean.alarm is None
    leaking = LeakDetector.for_handles(cfg, where="rank 1 (EP rank 1 of 2)")
    verdicts = feed(leaking, [2 * step for step in range(1, 31)])
    assert leaking.alarm is verdicts[ALARM_STEP - 1] and leaking.alarm.slope_per_step == 2
    assert leaking.scalars(leaking.alarm) == {HANDLES.slope_tag: 2.0, HANDLES.alarm_tag: 1.0}
    assert HANDLES.slope_tag == "moe/live_handles/leak_slope_per_step" and HANDLE_THRESHOLD_PER_STEP == 0.1
    with pytest.raises(MemoryLeakError, match=r"^rank 1 \(EP rank 1 of 2\): handle leak: MoE comm handles alive at "
                                              r"step end grow 2 handles/step \(Theil-Sen slope over steps 10-19; "
                                              r"threshold 0.1 handles/step\); set memory.fail_on_leak = false"):
        leaking.check()
    assert not LeakDetector.for_handles(load_config(["--memory.leak_window", "0"]).memory).enabled


@pytest.fixture(autouse=True)
def _one_thread():
    # The small model's ops are tiny: a second intra-op thread only adds synchronisation, which on a busy
    # 2-core machine made steps several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small_model_config(module_tmp_path):
    """An HF config.json of the debug flavor cut down to 2 layers (1 dense + 1 MoE) at width 64."""
    return hf_config_file(TINY, module_tmp_path)


def make_trainer(small_model_config, dump, *overrides) -> Trainer:
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(dump),
                       "--model.hf_config_path", small_model_config, "--training.seq_len", "32",
                       "--training.local_batch_size", "2", "--training.steps", "25", "--validation.enable", "false",
                       "--metrics.enable_tensorboard", "false", "--memory.track", "exact",
                       "--memory.leak_threshold_MiB_per_step", str(THRESHOLD_MIB), *overrides])
    return Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))


def train_watched(trainer: Trainer) -> tuple[LeakDetector, list, MemorySnapshots]:
    """The memory part of `Trainer.train`'s loop, with the detector and snapshots wired in as documented."""
    cfg = trainer.cfg
    snapshots = MemorySnapshots(trainer.memory, os.path.join(cfg.job.dump_folder, "memory_snapshots"),
                                cfg.memory.snapshot_freq, cfg.memory.dump_on_leak)
    detector = LeakDetector.from_config(cfg.memory, on_leak=snapshots.on_leak)
    verdicts = []
    with trainer.memory, snapshots:
        for step in range(1, cfg.training.steps + 1):
            trainer.train_step(step)
            mem = trainer.memory.step_end()
            snapshots.step_end(step)
            verdicts.append(detector.update(step, mem.allocated_bytes, mem.breakdown))
            detector.check()
            if trainer.val_loader is not None and step % cfg.validation.freq == 0:
                trainer.validate()
    return detector, verdicts, snapshots


def test_leak_a_tensor_kept_in_a_list_every_step_stops_the_run(small_model_config, tmp_path, monkeypatch):
    steps_run, kept = [], []
    train_step = Trainer.train_step

    def leaky_train_step(self, step):
        steps_run.append(step)
        kept.append(torch.empty(4 * KiB))  # 16 KiB of float32 per step
        return train_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", leaky_train_step)
    # exact: the tracker counts bytes and the median of identical pairwise slopes is that slope
    with pytest.raises(MemoryLeakError, match=r"grows 0.01562 MiB/step \(Theil-Sen slope over steps 10-19"):
        train_watched(make_trainer(small_model_config, tmp_path, "--memory.fail_on_leak", "true"))
    assert steps_run[-1] == ALARM_STEP
    table = json.loads((tmp_path / "memory_snapshots" / f"rank0_step{ALARM_STEP:06d}_leak.json").read_text())
    assert table["last_step"]["allocated_bytes"] == table["current"]["Total"]


def test_a_run_stopped_by_the_leak_detector_logs_its_alarm_step_first(small_model_config, tmp_path, monkeypatch):
    """With fail_on_leak the run stops at the alarm, and tensorboard already holds that step (its allocation, its
    slope and the alarm marker): `trainer.plot_memory` reports the leak like the console (before, the alarm's step
    never reached tensorboard and the plot said "no leak")."""
    from trainer.tools.plot_memory import find_run, load_run

    kept = []
    train_step = Trainer.train_step

    def leaky_train_step(self, step):
        kept.append(torch.empty(256 * KiB // 4))  # 256 KiB per step, well above the threshold
        return train_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", leaky_train_step)
    trainer = make_trainer(small_model_config, tmp_path, "--memory.fail_on_leak", "true",
                           "--metrics.enable_tensorboard", "true", "--memory.leak_threshold_MiB_per_step", "0.1")
    with pytest.raises(MemoryLeakError):
        try:
            trainer.train()
        finally:
            trainer.close()
    [run] = load_run(find_run(str(tmp_path))).ranks  # a single process: its spread is its own curves
    assert run.run_alarm_step == ALARM_STEP
    assert run.series["memory/allocated_GiB"][0][-1] == ALARM_STEP
    assert run.alarm is not None and run.alarm.step == ALARM_STEP  # the replay agrees
    assert "memory leak" in run.summary()


def test_leak_autograd_graph_kept_by_a_long_lived_buffer(small_model_config, tmp_path, caplog):
    # torchtitan #979: tokens copied in place into a persistent send buffer with a grad-carrying tensor. The
    # buffer joins the autograd graph (CopySlices) and each step's copy chains onto the previous one, so the
    # tensors saved by the ops feeding the copy (silu keeps its input, indexing its indices) are never freed:
    # no backward ever runs through the buffer.
    trainer = make_trainer(small_model_config, tmp_path)
    send_buf = torch.zeros(1024, 64)

    def copy_into_send_buffer(module, args, output):
        x_TD = args[0].reshape(-1, 64)
        order = torch.arange(x_TD.shape[0] - 1, -1, -1)
        send_buf[:x_TD.shape[0]].copy_(F.silu(x_TD)[order])

    for moe in trainer.model_parts[0].moe_layers():
        moe.register_forward_hook(copy_into_send_buffer)
    with caplog.at_level(logging.WARNING, logger="trainer.memory.leak_detector"):
        detector, verdicts, _ = train_watched(trainer)
    assert send_buf.grad_fn is not None
    # per MoE layer and step: the saved 64 x 64 float32 input of silu and the 64 int64 indices
    assert detector.alarm.step == ALARM_STEP
    assert detector.alarm.slope_per_step == 64 * 64 * 4 + 64 * 8
    assert detector.alarm.message().endswith("mostly activations (+0.145 MiB over the window)")
    assert len([r for r in caplog.records if "memory leak" in r.getMessage()]) == 1
    assert all(v.leaking for v in verdicts[ALARM_STEP - 1:])


def cache_router_outputs(trainer: Trainer, pop_in_backward: bool) -> dict:
    """A module-level handle cache: each MoE layer stores its routing per forward under a fresh key.

    With ``pop_in_backward`` the entry is released by a hook in backward, like the DeepEP handle cache of
    torchtitan #2273: fine in training, but a no_grad (validation) forward has no backward and leaks it.
    """
    cache = {}

    def store_routing(router, args, output):
        topk_weights_TK, topk_idx_TK, _ = output
        key = object()  # a fresh key per call, as handle ids are
        cache[key] = (topk_weights_TK.detach(), topk_idx_TK.detach())
        if pop_in_backward and topk_weights_TK.requires_grad:
            def release(grad):
                del cache[key]

            topk_weights_TK.register_hook(release)

    for moe in trainer.model_parts[0].moe_layers():
        moe.router.register_forward_hook(store_routing)
    return cache


def test_leak_handle_cache_never_popped(small_model_config, tmp_path):
    trainer = make_trainer(small_model_config, tmp_path)
    cache = cache_router_outputs(trainer, pop_in_backward=False)
    detector, _, _ = train_watched(trainer)
    assert len(cache) == 25
    # per MoE layer and step: top-3 weights (float32) and indices (int64) of 64 tokens
    assert detector.alarm.step == ALARM_STEP
    assert detector.alarm.slope_per_step == 64 * 3 * (4 + 8)


def test_leak_handle_cache_popped_only_in_backward_leaks_in_validation(small_model_config, tmp_path):
    trainer = make_trainer(small_model_config, tmp_path, "--validation.enable", "true", "--validation.freq", "2",
                           "--validation.steps", "2")
    cache = cache_router_outputs(trainer, pop_in_backward=True)
    detector, _, _ = train_watched(trainer)
    # every training forward was released in backward: what is left comes from the validation forwards alone
    assert len(cache) == 2 * (25 // 2)
    assert detector.alarm is not None
    # the average rate: two validation batches' routing every 2 steps
    assert detector.alarm.slope_per_step == 64 * 3 * (4 + 8)


@pytest.mark.slow
def test_clean_run_of_50_steps_never_alarms(small_model_config, tmp_path):
    trainer = make_trainer(small_model_config, tmp_path, "--training.steps", "50", "--validation.enable", "true",
                           "--validation.freq", "5", "--memory.leak_threshold_MiB_per_step", "1e-6")
    detector, verdicts, _ = train_watched(trainer)
    assert detector.alarm is None
    slopes = [v.slope_per_step for v in verdicts if v is not None]
    assert len(slopes) == 50 - 14 and max(map(abs, slopes)) == 0
    assert not os.path.exists(tmp_path / "memory_snapshots")


# ----------------------------------------------------------------------------------------------------------
# Snapshots


def test_dump_table_on_cpu_lists_categories_storages_and_modules(small_model_config, tmp_path):
    trainer = make_trainer(small_model_config, tmp_path)
    with trainer.memory:
        trainer.train_step(1)
        stats = trainer.memory.step_end()
        table = trainer.memory.dump_table(str(tmp_path / "table.json"))
        trainer.memory.dump_table(str(tmp_path / "table.txt"))
    assert json.loads((tmp_path / "table.json").read_text()) == table
    assert table["mode"] == "exact" and table["last_step"]["allocated_bytes"] == stats.allocated_bytes
    assert table["current"]["Total"] == stats.allocated_bytes
    assert sum(c["bytes"] for c in table["live_storages"].values()) == stats.allocated_bytes
    n_params = sum(1 for _ in trainer.model_parts[0].parameters())
    assert table["live_storages"]["Parameter"]["count"] == n_params
    assert table["largest_storages"][0]["bytes"] == max(
        p.numel() * 4 for p in trainer.model_parts[0].parameters())
    modules = {row["module"]: row for row in table["modules"]}
    moe = modules["DeepSeekV3Model.layers.1.moe"]
    assert moe["forward_calls"] == 1 and moe["forward_retained_bytes"] > 0
    assert moe["peak_forward_bytes"] > 0  # per-module backward peaks are not tracked (see _ForwardOnlyModTracker)
    text = (tmp_path / "table.txt").read_text()
    assert "Parameter" in text and "layers.1.moe" in text


def test_periodic_snapshots_on_cpu(small_model_config, tmp_path):
    trainer = make_trainer(small_model_config, tmp_path, "--training.steps", "6", "--memory.snapshot_freq", "3")
    train_watched(trainer)
    assert sorted(os.listdir(tmp_path / "memory_snapshots")) == ["rank0_step000003_periodic.json",
                                                                 "rank0_step000006_periodic.json"]


def test_dump_table_in_off_mode_says_so(tmp_path):
    monitor = MemoryMonitor("cpu", mode="off")
    with monitor:
        assert monitor.dump_table(str(tmp_path / "t.json")) == {"device": "cpu", "mode": "off"}


@pytest.mark.cuda
def test_cuda_snapshots_periodic_with_history_and_on_oom(tmp_path):
    monitor = MemoryMonitor(torch.device("cuda"))
    snapshots = MemorySnapshots(monitor, str(tmp_path), freq=1)
    with pytest.raises(torch.OutOfMemoryError):
        with monitor, snapshots:
            kept = torch.empty(MiB, device="cuda")
            monitor.step_end()
            snapshots.step_end(1)
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert kept.numel() == MiB
    with open(tmp_path / "rank0_step000001_periodic.pickle", "rb") as f:
        periodic = pickle.load(f)
    assert periodic["segments"] and any(periodic["device_traces"])  # history was recorded
    with open(tmp_path / "rank0_step000002_oom.pickle", "rb") as f:  # the step that failed
        oom = pickle.load(f)
    assert any(event["action"] == "oom" for trace in oom["device_traces"] for event in trace)
