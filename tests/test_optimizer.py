"""The optimizer: tiling into parameter groups, bit-identical steps, the capped transient, LR schedule and state."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from small_models import TINY, hf_config_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainer.job_config import load_config
from trainer.lr_schedule import build_lr_scheduler
from trainer.memory.monitor import MemoryMonitor
from trainer.optimizer import build_optimizer, tile_params
from trainer.train import Trainer, prepare

FLOAT_BYTES = 4
LAYER_BYTES = (256 * 256 + 256) * FLOAT_BYTES


def opt_cfg(max_group_bytes: int = 0, implementation: str = "foreach"):
    return SimpleNamespace(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                           implementation=implementation, max_group_bytes=max_group_bytes)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, monitor: MemoryMonitor | None = None):
    """`steps` steps on a tiny batch (the optimizer step is the peak); returns each step's peak if monitored."""
    gen = torch.Generator().manual_seed(1)
    peaks = []
    for _ in range(steps):
        model(torch.randn(2, 256, generator=gen)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            peaks.append(monitor.step_end().peak_bytes)
    return peaks


def test_tile_params_keeps_order_and_caps_bytes():
    params = [torch.zeros(n) for n in (10, 20, 5, 100, 1, 1)]
    tiles = tile_params(params, max_group_bytes=30 * FLOAT_BYTES)
    assert [[p.numel() for p in tile] for tile in tiles] == [[10, 20], [5], [100], [1, 1]]
    assert [p for tile in tiles for p in tile] == params
    assert tile_params(params, 0) == [params] and tile_params([], 64) == []


@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
def test_tiled_step_is_bit_identical(implementation):
    whole, tiled = make_model(), make_model()
    opt_whole = build_optimizer([whole], opt_cfg(0, implementation))
    opt_tiled = build_optimizer([tiled], opt_cfg(LAYER_BYTES * 3, implementation))
    assert (len(opt_whole.param_groups), len(opt_tiled.param_groups)) == (1, 3)
    run(whole, opt_whole, 5)
    run(tiled, opt_tiled, 5)
    for a, b in zip(whole.parameters(), tiled.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt_whole.state[a]["exp_avg_sq"], opt_tiled.state[b]["exp_avg_sq"])


def test_tiling_caps_the_foreach_transient_exactly():
    param_bytes = 8 * LAYER_BYTES
    peaks = {}
    for max_group_bytes in (0, LAYER_BYTES):
        model = make_model()
        optimizer = build_optimizer([model], opt_cfg(max_group_bytes))
        monitor = MemoryMonitor("cpu", mode="exact")
        monitor.track(model, optimizer)
        with monitor:
            peaks[max_group_bytes] = run(model, optimizer, 3, monitor)
    # foreach AdamW holds sqrt(exp_avg_sq) of a whole group at once: all parameters untiled, one layer tiled
    assert [a - b for a, b in zip(peaks[0], peaks[LAYER_BYTES])] == [param_bytes - LAYER_BYTES] * 3
    # at the step: parameters, gradients, two moments, that transient and the per-tensor step counters
    assert peaks[0][-1] == 5 * param_bytes + 16 * FLOAT_BYTES


def test_lr_schedule_and_zero_grad_reach_every_group():
    model = make_model()
    optimizer = build_optimizer([model], opt_cfg(LAYER_BYTES))
    sched_cfg = SimpleNamespace(warmup_steps=2, decay_type="linear", decay_ratio=1.0, min_lr_factor=0.0)
    scheduler = build_lr_scheduler(optimizer, sched_cfg, total_steps=10)
    for _ in range(3):
        run(model, optimizer, 1)
        scheduler.step()
        lrs = {group["lr"] for group in optimizer.param_groups}
        assert lrs == {scheduler.get_last_lr()[0]}
    model(torch.randn(2, 256)).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_and_dcp_across_tilings():
    model = make_model()
    optimizer = build_optimizer([model], opt_cfg(LAYER_BYTES * 2))
    run(model, optimizer, 2)

    def resumed(max_group_bytes, load):
        clone = make_model(seed=1)
        clone.load_state_dict(model.state_dict())
        clone_opt = build_optimizer([clone], opt_cfg(max_group_bytes))
        load(clone, clone_opt)
        return clone, clone_opt

    # Each load gets its own deep copy, as if read from a file: loading keeps the given moment tensors, which
    # would otherwise be shared with `optimizer` and between the clones.
    plain = resumed(LAYER_BYTES * 2, lambda m, o: o.load_state_dict(copy.deepcopy(optimizer.state_dict())))
    # DCP keys state by parameter name, so a checkpoint loads into another tiling (or none)
    dcp_state = get_optimizer_state_dict(model, optimizer)
    assert len(dcp_state["param_groups"]) == 4
    dcp_untiled = resumed(0, lambda m, o: set_optimizer_state_dict(m, o, copy.deepcopy(dcp_state)))
    dcp_retiled = resumed(LAYER_BYTES * 3, lambda m, o: set_optimizer_state_dict(m, o, copy.deepcopy(dcp_state)))
    run(model, optimizer, 2)
    for clone, clone_opt in (plain, dcp_untiled, dcp_retiled):
        run(clone, clone_opt, 2)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters()))


def test_trainer_tiled_run_is_bit_identical(tmp_path):
    """The real training step (clipping, LR schedule, MoE bias update) on a small DeepSeek-V3, tiled vs not."""
    hf_config = hf_config_file(TINY, tmp_path)
    params = {}
    for max_group_bytes in (0, 64 << 10):
        cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                           str(tmp_path), "--model.hf_config_path", str(hf_config), "--training.seq_len", "32",
                           "--training.local_batch_size", "2", "--training.deterministic", "true",
                           "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                           "--memory.track", "off", "--optimizer.max_group_bytes", str(max_group_bytes)])
        trainer = Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))
        for step in range(1, 5):
            trainer.train_step(step)
        params[max_group_bytes] = list(trainer.model_parts[0].parameters())
        if max_group_bytes:
            assert len(trainer.optimizers[0].param_groups) > 3
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[64 << 10]))
