"""Tests of MemoryMonitor: exact CPU accounting (leaks, per-step peak, breakdown), the off mode and the CUDA path."""

import logging
import os
import subprocess

import pytest
import torch
import torch.nn as nn

from trainer.memory.monitor import MemoryMonitor, MemoryStats

MiB = 1 << 20
FLOAT_BYTES = 4
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * FLOAT_BYTES for p in model.parameters())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, microbatches: int = 1) -> None:
    for _ in range(microbatches):
        model(torch.randn(8, 32)).pow(2).mean().backward()
    optimizer.step()
    # Keep the gradients (set_to_none=False) so that the breakdown has all three kinds of training state.
    optimizer.zero_grad(set_to_none=False)


def run_steps(steps: int, leak_bytes: int = 0, microbatches: int = 1) -> list[MemoryStats]:
    model, optimizer = make_mlp()
    monitor = MemoryMonitor(torch.device("cpu"), mode="exact")
    monitor.track(model, optimizer)
    leaked, stats = [], []
    with monitor:
        for _ in range(steps):
            train_step(model, optimizer, microbatches)
            if leak_bytes:
                leaked.append(torch.empty(leak_bytes // FLOAT_BYTES))
            stats.append(monitor.step_end())
    return stats


def deltas(stats: list[MemoryStats]) -> list[int]:
    """Step-to-step change of allocated bytes after the first (warm-up: optimizer state appears) step."""
    return [b.allocated_bytes - a.allocated_bytes for a, b in zip(stats[1:], stats[2:])]


def test_cpu_auto_is_exact_and_off_is_off():
    assert MemoryMonitor("cpu").mode == "exact"
    assert MemoryMonitor("cpu", mode="off").mode == "off"
    with pytest.raises(ValueError, match="auto"):
        MemoryMonitor("cpu", mode="fast")


def test_no_leak_is_flat_and_leak_is_exact():
    assert deltas(run_steps(6)) == [0] * 4
    assert deltas(run_steps(6, leak_bytes=MiB)) == [MiB] * 4


def test_breakdown_magnitudes_for_known_model():
    model, _ = make_mlp()
    n_param_bytes = param_bytes(model)
    n_tensors = len(list(model.parameters()))
    stats = run_steps(3)[-1]
    assert stats.breakdown["parameters"] == n_param_bytes
    assert stats.breakdown["gradients"] == n_param_bytes
    # AdamW: exp_avg and exp_avg_sq like the parameter, plus one float32 "step" scalar per parameter tensor.
    assert stats.breakdown["optimizer_state"] == 2 * n_param_bytes + n_tensors * FLOAT_BYTES
    assert sum(stats.breakdown.values()) == stats.allocated_bytes
    assert sum(stats.peak_breakdown.values()) == stats.peak_bytes


def test_optimizer_state_counted_once_when_tracked_again():
    model, optimizer = make_mlp()
    monitor = MemoryMonitor("cpu")
    monitor.track(model, optimizer)
    with monitor:
        train_step(model, optimizer)  # AdamW creates its state lazily, inside the tracked region
        first = monitor.step_end()
        monitor.track(model, optimizer)  # registering the same storages again must not count them twice
        train_step(model, optimizer)
        second = monitor.step_end()
    assert first.breakdown == second.breakdown
    assert second.breakdown["optimizer_state"] == 2 * param_bytes(model) + 4 * FLOAT_BYTES


def test_state_created_before_entering_is_counted_via_track():
    model, optimizer = make_mlp()
    train_step(model, optimizer)  # gradients and optimizer state exist before the monitor is entered
    monitor = MemoryMonitor("cpu")
    monitor.track(model, optimizer)
    with monitor:
        stats = monitor.step_end()
    assert stats.breakdown["gradients"] == param_bytes(model)
    assert stats.breakdown["optimizer_state"] == 2 * param_bytes(model) + 4 * FLOAT_BYTES


def test_peak_is_the_peak_within_the_step():
    monitor = MemoryMonitor("cpu")
    keep = torch.ones(MiB // FLOAT_BYTES)
    monitor.track(keep)
    with monitor:
        base = monitor.step_end().allocated_bytes
        assert base == MiB
        # By hand: a (2 MiB) and b (3 MiB) overlap, then c (1 MiB) lives alone; the peak is base + 5 MiB.
        a = torch.empty(2 * MiB // FLOAT_BYTES)
        b = torch.empty(3 * MiB // FLOAT_BYTES)
        del a
        c = torch.empty(MiB // FLOAT_BYTES)
        del b
        step = monitor.step_end()
        assert (step.allocated_bytes, step.peak_bytes) == (base + MiB, base + 5 * MiB)
        del c
        quiet = monitor.step_end()
        # The peak restarts from the level at the last step_end (base + 1 MiB), not from the run's peak.
        assert (quiet.allocated_bytes, quiet.peak_bytes) == (base, base + MiB)


def test_a_nested_fake_modes_tensors_are_not_counted():
    """DTensor's sharding propagation runs ops on fake tensors under a FakeTensorMode of its own, inside the
    tracker: they hold no memory. torch 2.11's MemTracker counted them (a 4-rank FSDP + EP step peaked 0.18 GiB
    high); the tracker skips them on every torch, as 2.13's does, while real tensors of the same step count."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monitor = MemoryMonitor("cpu")
    with monitor:
        base = monitor.step_end().allocated_bytes
        with FakeTensorMode():
            fake = torch.empty(64 * MiB // FLOAT_BYTES)
            (fake * 2).sum()
        real = torch.empty(MiB // FLOAT_BYTES)
        step = monitor.step_end()
    assert (step.allocated_bytes, step.peak_bytes) == (base + MiB, base + MiB)
    del real


def test_peak_of_training_step_with_temporary_then_reset():
    model, optimizer = make_mlp()
    monitor = MemoryMonitor("cpu")
    monitor.track(model, optimizer)
    peaks, temp_step = [], 3
    with monitor:
        for step in range(5):
            train_step(model, optimizer)
            if step == temp_step:
                torch.empty(4 * MiB // FLOAT_BYTES)  # a temporary: freed at once, seen only in the step's peak
            peaks.append(monitor.step_end())
    with_temp = peaks[temp_step]
    assert with_temp.peak_bytes >= with_temp.allocated_bytes + 4 * MiB
    assert peaks[temp_step + 1].peak_bytes == peaks[temp_step - 1].peak_bytes < 4 * MiB


def test_gradient_accumulation_calls_model_twice_per_step():
    # Plain MemTracker raises NotImplementedError on the second forward of the root module within a step.
    stats = run_steps(4, microbatches=2)
    assert deltas(stats) == [0] * 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 96), nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stage(nn.Module):
    """Three blocks, the middle one recomputed in backward, the last called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)
        return self.blocks[2](self.blocks[2](x))


def _peaks_and_module_stats(tracker_class: type) -> list:
    """Three steps of two microbatches through two stages of one class (their module names clash, as two
    pipeline stages' can), then a linear called alone, inside a wrapper seen for the first time (which renames
    it) and alone again: each step's totals and peaks, and every module's peak and forward snapshots."""
    torch.manual_seed(0)
    stages = nn.ModuleList([_Stage(), _Stage()])
    alone = nn.Linear(32, 32)
    wrapper = nn.Sequential(alone)
    optimizer = torch.optim.AdamW([*stages.parameters(), *alone.parameters()], lr=1e-3)
    monitor = MemoryMonitor("cpu", mode="exact")
    monitor._tracker = tracker_class()
    monitor.track(stages, optimizer)
    seen = []
    with monitor:
        for _ in range(3):
            for _ in range(2):
                y = stages[1](stages[0](torch.randn(16, 32)))
                alone(wrapper(alone(y))).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = monitor.step_end()
            modules = [(s.mod_fqn, dict(s.local_peak), {str(k): v for k, v in s.snapshots.items()})
                       for s in monitor._tracker.last_step_mod_stats.values()]
            seen.append((stats.allocated_bytes, stats.peak_bytes, stats.peak_breakdown, sorted(modules, key=str)))
    return seen


def test_peak_updates_match_stock_memtracker():
    """The tracker updates peaks for the running modules only (a lookup by name, trainer/memory/tracker.py);
    stock MemTracker loops over every module seen. Totals, peaks and every module's snapshots are the same."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.memory.tracker import _StepMemTracker

    class StockPeaks(_StepMemTracker):
        _update_peak_stats = MemTracker._update_peak_stats

    ours, stock = _peaks_and_module_stats(_StepMemTracker), _peaks_and_module_stats(StockPeaks)
    assert ours == stock
    assert all(peak > allocated for allocated, peak, _, _ in ours)
    names = [name for name, _, _ in ours[-1][3]]
    assert names.count("_Stage.blocks.2") == 2 and "Sequential.0" in names, names
    assert all(peaks for _, peaks, _ in ours[-1][3])


def rss_bytes() -> int:
    """This process's resident set size, read independently of trainer.memory (ps reports KiB)."""
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True, text=True,
                              check=True).stdout) * 1024


@pytest.mark.parametrize("mode, compiled, why", [("off", False, "memory.track = off"),
                                                 ("auto", True, "compile.enable = true")])
def test_off_mode_measures_only_rss_and_says_why(caplog, mode, compiled, why):
    caplog.set_level(logging.INFO, logger="trainer.memory.monitor")
    model, optimizer = make_mlp()
    monitor = MemoryMonitor("cpu", mode=mode, compiled=compiled)
    assert monitor.mode == "off"
    assert len(caplog.messages) == 1 and why in caplog.messages[0] and "only the process RSS" in caplog.messages[0]
    monitor.track(model, optimizer)
    with monitor:
        train_step(model, optimizer)
        stats = monitor.step_end()
        reference = rss_bytes()
    # nothing but the RSS was measured, so nothing else may look like a measurement (no zeros)
    assert stats == MemoryStats(rss_bytes=stats.rss_bytes)
    assert stats.rss_bytes == pytest.approx(reference, rel=0.05)
    assert MemoryMonitor.to_scalars(stats) == {"memory/rss_GiB": stats.rss_bytes / 2**30}


def test_to_scalars_keys_and_units():
    stats = MemoryStats(
        allocated_bytes=1 << 30,
        peak_bytes=3 << 29,
        reserved_bytes=2 << 30,
        rss_bytes=1 << 28,
        num_alloc_retries=2,
        num_ooms=1,
        breakdown={"parameters": 1 << 29, "activations": 1 << 29, "gradients": 0, "other": 1 << 20},
        peak_breakdown={"parameters": 1 << 29, "activations": 1 << 30, "other": 1 << 20},
    )
    # of the breakdowns only what varies: no flat parameters line, no step-end category that a healthy step
    # leaves at zero (activations left at step end are a leak's trace)
    assert MemoryMonitor.to_scalars(stats) == {
        "memory/allocated_GiB": 1.0,
        "memory/peak_allocated_GiB": 1.5,
        "memory/reserved_GiB": 2.0,
        "memory/rss_GiB": 0.25,
        "memory/num_alloc_retries": 2.0,
        "memory/num_ooms": 1.0,
        "memory/breakdown/activations_GiB": 0.5,
        "memory/peak_breakdown/activations_GiB": 1.0,
        "memory/peak_breakdown/other_GiB": 1 / 1024,
    }


def test_cpu_exact_measures_rss_and_has_no_allocator_fields():
    with MemoryMonitor("cpu") as monitor:
        stats = monitor.step_end()
        reference = rss_bytes()
    assert stats.rss_bytes == pytest.approx(reference, rel=0.05)
    assert (stats.reserved_bytes, stats.num_alloc_retries, stats.num_ooms) == (None, None, None)
    scalars = MemoryMonitor.to_scalars(stats)
    assert not {"memory/reserved_GiB", "memory/num_alloc_retries", "memory/num_ooms"} & set(scalars)
    assert scalars["memory/allocated_GiB"] == stats.allocated_bytes / 2**30


def test_misuse_is_an_error():
    monitor = MemoryMonitor("cpu", mode="off")
    with pytest.raises(RuntimeError, match="inside"):
        monitor.step_end()
    with monitor:
        pass
    with pytest.raises(RuntimeError, match="only once"):
        monitor.__enter__()


def test_compiled_model_is_refused_with_a_hint():
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].compile(backend="eager")  # nothing compiles before the first call; "eager" skips importing inductor
    with pytest.raises(ValueError, match='memory.track = "off"'):
        MemoryMonitor("cpu").track(model)
    MemoryMonitor("cpu", mode="off").track(model)


def test_op_error_inside_the_tracker_gets_a_hint():
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        with MemoryMonitor("cpu"):
            torch.randn(2, 3) @ torch.randn(4, 5)
    assert any('memory.track = "off"' in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.cuda
@needs_cuda
def test_cuda_auto_reads_allocator_and_resets_peak():
    monitor = MemoryMonitor(torch.device("cuda"))
    assert monitor.mode == "allocator"
    with monitor:
        base = monitor.step_end()
        scratch = torch.empty(64 * MiB // FLOAT_BYTES, device="cuda")
        del scratch
        with_temp = monitor.step_end()
        after = monitor.step_end()
    assert with_temp.peak_bytes >= base.allocated_bytes + 64 * MiB
    assert after.peak_bytes < base.allocated_bytes + 64 * MiB
    assert with_temp.reserved_bytes >= 64 * MiB
    assert with_temp.breakdown == {}


@pytest.mark.cuda
@needs_cuda
def test_cuda_exact_counts_leak():
    model = nn.Linear(256, 256, device="cuda")
    monitor = MemoryMonitor(torch.device("cuda"), mode="exact")
    monitor.track(model)
    leaked, stats = [], []
    with monitor:
        for _ in range(4):
            model(torch.randn(8, 256, device="cuda")).sum().backward()
            leaked.append(torch.empty(MiB // FLOAT_BYTES, device="cuda"))
            stats.append(monitor.step_end())
    assert deltas(stats) == [MiB] * 2
    assert stats[-1].breakdown["parameters"] == param_bytes(model)
