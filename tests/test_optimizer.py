"""The optimizer: tiling into parameter groups, bit-identical steps, the capped transient, LR schedule and state;
BF16 moments (optimizer.state_dtype): the step against an fp64 reference (moments rounded to nearest and
stochastically), state dtypes and placements, checkpoints and their conversion, the memory saved (measured and
planned), the loss curve, FSDP2 + DCP on 2 ranks, stochastic rounding alike on every layout.

Run as a script, this file is the rank worker of the 2-rank test."""

import copy
import functools
import logging
import os
import sys
import zlib
from types import SimpleNamespace

import numpy as np

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from small_models import SMALL, TINY, hf_config_file
from test_stochastic_rounding import lowbias32, reference_round
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainer.checkpoint.states import OptimizerState
from trainer.job_config import load_config
from trainer.lr_schedule import build_lr_scheduler
from trainer.memory.monitor import MemoryMonitor
from trainer.optimizer import (BF16MomentsAdamW, adamw_tensor_step, build_optimizer, grad_scale_in_kernel,
                               skippable_tensor_step, tile_params)
from trainer.stochastic_rounding import CHUNK_ELEMENTS, TRANSIENT_BYTES_PER_ELEMENT, kernel_site
from trainer.tools.memory_plan import plan
from trainer.train import Trainer, prepare, run as train_run

FLOAT_BYTES = 4
LAYER_BYTES = (256 * 256 + 256) * FLOAT_BYTES
WEIGHT_BYTES = 256 * 256 * FLOAT_BYTES
MOMENTS = ("exp_avg", "exp_avg_sq")


def opt_cfg(max_group_bytes: int = 0, implementation: str = "foreach", state_dtype: str = "float32",
            state_rounding: str = "stochastic", **hyper):
    return SimpleNamespace(**{**dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1), **hyper},
                           implementation=implementation, max_group_bytes=max_group_bytes, state_dtype=state_dtype,
                           state_rounding=state_rounding)


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


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
def test_tiled_step_is_bit_identical(implementation, state_dtype):
    whole, tiled = make_model(), make_model()
    opt_whole = build_optimizer([whole], opt_cfg(0, implementation, state_dtype))
    opt_tiled = build_optimizer([tiled], opt_cfg(LAYER_BYTES * 3, implementation, state_dtype))
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


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_state_dict_round_trip_and_dcp_across_tilings(state_dtype):
    model = make_model()
    optimizer = build_optimizer([model], opt_cfg(LAYER_BYTES * 2, state_dtype=state_dtype))
    run(model, optimizer, 2)

    def resumed(max_group_bytes, load):
        clone = make_model(seed=1)
        clone.load_state_dict(model.state_dict())
        clone_opt = build_optimizer([clone], opt_cfg(max_group_bytes, state_dtype=state_dtype))
        load(clone, clone_opt)
        # loaded moments keep the optimizer's dtype (torch's load would cast them to the parameters' float32)
        for p in clone.parameters():
            assert [clone_opt.state[p][k].dtype for k in MOMENTS] == [getattr(torch, state_dtype)] * 2
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


# ------------------------------------------------------------------------------------------------------ BF16 moments

SHAPES = [(64, 32), (32,), (256, 4), (1,), (8, 8, 3)]


def reference_moment_rounding(rounding: str, name: str, step: int, tag: int, value: torch.Tensor) -> torch.Tensor:
    """`value` (float64, exactly a float32) as the optimizer stores it in bfloat16: to nearest, or stochastically
    with the random bits that docs/memory.md defines: the parameter's key crc32("<seed>:<name>") (seed 0), the salt
    lowbias32(lowbias32(key ^ tag) ^ step), the element's index in the tensor."""
    if rounding == "nearest":
        return value.bfloat16().double()
    key = np.array([zlib.crc32(f"0:{name}".encode())])
    salt_ = int(lowbias32(lowbias32(key ^ np.uint32(tag)) ^ np.uint32(step))[0])
    flat = value.float().reshape(-1)
    return reference_round(flat, np.arange(flat.numel()), salt_).view(value.shape).double()


def reference_adamw(params, grads_per_step, lr, betas, eps, weight_decay, rounding="nearest"):
    """AdamW in float64 written out plainly, the stored moments rounded to bfloat16 after every update (parameter
    names are their positions, as in an nn.ParameterList): the parameters after the steps and the final stored
    moments."""
    b1, b2 = betas
    ps = [p.detach().double() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_per_step, 1):
        for i, g in enumerate(grads):
            g = g.double()
            m = b1 * ms[i] + (1 - b1) * g
            v = b2 * vs[i] + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            ps[i] = ps[i] * (1 - lr * weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
            ms[i] = reference_moment_rounding(rounding, str(i), t, 0, m)
            vs[i] = reference_moment_rounding(rounding, str(i), t, 1, v)
    return ps, ms, vs


def _tensors(seed: int = 0):
    """Parameters of SHAPES, and 6 steps of gradients that are multiples of 1/16 in [-1/2, 1/2]: with betas 1/2 and
    3/4 every moment update is exact in float32 and float64 alike, so the bfloat16 rounding of both is the same."""
    gen = torch.Generator().manual_seed(seed)
    params = nn.ParameterList([nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES])
    grads = [[torch.randint(-8, 9, shape, generator=gen) / 16 for shape in SHAPES] for _ in range(6)]
    return params, grads


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("max_group_bytes", [0, 1024 * FLOAT_BYTES], ids=["whole", "tiled"])
@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
def test_bf16_moments_step_matches_an_fp64_reference(implementation, max_group_bytes, rounding):
    cfg = opt_cfg(max_group_bytes, implementation, "bfloat16", rounding, lr=0.05, beta1=0.5, beta2=0.75)
    params, grads = _tensors()
    expected, exp_avgs, exp_avg_sqs = reference_adamw(params, grads, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps,
                                                      cfg.weight_decay, rounding)
    optimizer = build_optimizer([params], cfg)
    assert isinstance(optimizer, BF16MomentsAdamW) and isinstance(optimizer, torch.optim.AdamW)
    assert len(optimizer.param_groups) == (1 if max_group_bytes == 0 else 4)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    for p, want, m, v in zip(params, expected, exp_avgs, exp_avg_sqs):
        state = optimizer.state[p]
        assert p.dtype == torch.float32
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.bfloat16, torch.bfloat16)
        assert state["step"].dtype == torch.float32 and state["step"].item() == len(grads)
        # the stored moments: bit for bit the reference's; the parameters: float32 against float64 arithmetic
        assert torch.equal(state["exp_avg"].double(), m) and torch.equal(state["exp_avg_sq"].double(), v)
        torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=2e-6)


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values at or below and at or above float32 `x` in magnitude (equal where x is one)."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = torch.where(low == x, low, (low.view(torch.int32) + 65536).view(torch.float32))
    return low, high


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_moments_step_is_torch_adamw_up_to_the_rounding_of_the_moments(rounding):
    """Default hyperparameters, the same gaussian gradients into both: the first update equals torch's AdamW with
    float32 state (whose moments, rounded to nearest or to one of their two bfloat16 neighbours, are the stored
    ones); later ones differ only through that rounding."""
    cfg = opt_cfg(0, "fused", "bfloat16", rounding)
    params, _ = _tensors()
    reference = copy.deepcopy(params)
    optimizer = build_optimizer([params], cfg)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, foreach=False)
    gen = torch.Generator().manual_seed(2)
    steps = 8
    for step in range(1, steps + 1):
        for p, q in zip(params, reference):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        optimizer.step()
        torch_adamw.step()
        if step == 1:
            for p, q in zip(params, reference):
                torch.testing.assert_close(p, q, rtol=0, atol=3e-8)  # fp32 scalars in one, doubles in the other
                for key in MOMENTS:
                    stored, exact = optimizer.state[p][key].float(), torch_adamw.state[q][key]
                    if rounding == "nearest":
                        assert torch.equal(stored, exact.bfloat16().float())
                    else:
                        low, high = _bf16_neighbours(exact)
                        assert ((stored == low) | (stored == high)).all()
    # an update is at most ~1.2 lr (|m| <= 1.2 sqrt(v) at these betas); a moment rounded by up to 2^-9 of itself
    # changes it by ~2^-9 of that, every step
    worst = max((p - q).abs().max().item() for p, q in zip(params, reference))
    assert 0 < worst < steps * cfg.lr * 2 ** -7, worst


def test_stochastic_rounding_keeps_a_slow_second_moment_moving():
    """beta2 = 0.999, a constant gradient of 1 for 2000 steps: float32's second moment reaches 1 - 0.999^2000 =
    0.865. Rounded to nearest, each update (0.1% of the gap) falls below half a bfloat16 step once the gap is under
    ~3.5x the value, and the stored moment stalls at 0.25 for good; stochastically rounded, its mean over 4096
    elements follows float32's within 0.1%."""
    n, steps = 4096, 2000
    want = 1 - 0.999 ** steps
    for rounding, check in (("nearest", lambda v: torch.equal(v, torch.full((n,), 0.25))),
                            ("stochastic", lambda v: abs(v.mean().item() / want - 1) < 1e-3)):
        p, grad = torch.zeros(n), torch.ones(n)
        m, v, step = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.tensor(0.0)
        for _ in range(steps):
            adamw_tensor_step(p, grad, m, v, step, torch.tensor(0.0), beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.0, rounding=None if rounding == "nearest" else (torch.tensor(5), 0))
        assert check(v.float()), (rounding, v.float().mean().item(), want)


def test_dcp_state_initialisation_leaves_the_parameters_and_load_keeps_bf16():
    """DCP initialises an empty optimizer's state by a step with zero gradients at lr 0 (`_init_optim_state`): that
    step must leave the parameters as they are; state_dict/load_state_dict keep the moments in bfloat16."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer([model], opt_cfg(0, "fused", "bfloat16"))
    state = get_optimizer_state_dict(model, optimizer)  # creates the state through that step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {key: t.dtype for per_param in state["state"].values() for key, t in per_param.items()} == {
        "step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    plain = optimizer.state_dict()
    fresh = build_optimizer([model], opt_cfg(0, "fused", "bfloat16"))
    fresh.load_state_dict(copy.deepcopy(plain))
    assert all(fresh.state[p][k].dtype == torch.bfloat16 for p in model.parameters() for k in MOMENTS)


@pytest.mark.parametrize("saved_dtype, loaded_dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_checkpoint_of_the_other_state_dtype_converts_with_a_notice(tmp_path, saved_dtype, loaded_dtype):
    """DCP loads into the optimizer's own state tensors: a float32 checkpoint's moments are rounded to bfloat16
    (round to nearest, as .to() does), a bfloat16 one's widened exactly; the note names both dtypes."""
    model = make_model()
    saver = build_optimizer([model], opt_cfg(LAYER_BYTES, "fused", saved_dtype))
    run(model, saver, 2)
    dcp.save({"optimizer": OptimizerState([model], [saver])}, checkpoint_id=str(tmp_path))
    loader = build_optimizer([model], opt_cfg(0, "fused", loaded_dtype))
    flags = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in loader.param_groups]
    view = OptimizerState([model], [loader])
    dcp.load({"optimizer": view}, checkpoint_id=str(tmp_path))
    # this run's kernel flags, not the checkpoint's: torch's fused AdamW stays fused after a bf16 checkpoint
    assert flags == [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in loader.param_groups]
    for p in model.parameters():
        for key in MOMENTS:
            got, saved = loader.state[p][key], saver.state[p][key]
            assert got.dtype == getattr(torch, loaded_dtype) and torch.equal(got, saved.to(got.dtype))
        assert torch.equal(loader.state[p]["step"].cpu(), saver.state[p]["step"].cpu())
    assert view.conversion_note(str(tmp_path)) == (
        f"optimizer state converted on load: the checkpoint's AdamW moments are {saved_dtype}, this run keeps them "
        f"in {loaded_dtype} (optimizer.state_dtype)")
    same = build_optimizer([model], opt_cfg(0, "fused", saved_dtype))
    dcp.load({"optimizer": OptimizerState([model], [same])}, checkpoint_id=str(tmp_path))
    assert OptimizerState([model], [same]).conversion_note(str(tmp_path)) is None
    loader.found_inf = torch.zeros(())  # as the trainer steps a fused AdamW
    run(model, loader, 1)  # and it trains on


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("implementation, max_group_bytes", [("fused", 0), ("for-loop", 0), ("foreach", 0),
                                                             ("foreach", LAYER_BYTES)])
def test_bf16_moments_memory_measured_exactly(implementation, max_group_bytes, rounding):
    """The exact tracker on 8 linear layers: half the state, and the step's transient is float32 copies of both
    moments, of the largest tensor (one tensor at a time) or of the group (foreach), plus stochastic rounding's
    temporaries for one chunk of a tensor, as the memory plan counts it."""
    param_bytes = 8 * LAYER_BYTES
    measured = {}
    for state_dtype in ("float32", "bfloat16"):
        model = make_model()
        optimizer = build_optimizer([model], opt_cfg(max_group_bytes, implementation, state_dtype, rounding))
        monitor = MemoryMonitor("cpu", mode="exact")
        monitor.track(model, optimizer)
        with monitor:
            peaks = run(model, optimizer, 2, monitor)
        measured[state_dtype] = (monitor.last_stats.breakdown["optimizer_state"], peaks[-1])
    (state32, _), (state16, peak16) = measured["float32"], measured["bfloat16"]
    # 16 float32 step counters in both; the bfloat16 optimizer's 0-d learning rate is 4 bytes more, and with
    # stochastic rounding each parameter's key (0-d int64) 8 bytes each
    assert state32 == 2 * param_bytes + 16 * FLOAT_BYTES
    assert state16 == param_bytes + 16 * FLOAT_BYTES + FLOAT_BYTES + (16 * 8 if rounding == "stochastic" else 0)
    copied = 2 * ({"foreach": param_bytes if max_group_bytes == 0 else LAYER_BYTES}.get(implementation, WEIGHT_BYTES))
    if rounding == "stochastic":
        copied += min(WEIGHT_BYTES // FLOAT_BYTES, CHUNK_ELEMENTS) * TRANSIENT_BYTES_PER_ELEMENT
    # parameters, gradients, both bfloat16 moments (= the parameters' bytes) and the copies; 0-d scalars on top
    # (16 step counters, the lr, and foreach's three bias-correction lists: 4 + 16 x 4 x 4 bytes at most, 260;
    # stochastic rounding's 0-d salts)
    assert 0 <= peak16 - (3 * param_bytes + copied) <= 576


def test_found_inf_skips_the_bf16_step():
    """The found_inf protocol of torch's fused AdamW, which the trainer uses to skip a non-finite step without
    waiting: nothing changes, not even the step counters; the compiled kernel's form (run eagerly here) too."""
    params, grads = _tensors()
    optimizer = build_optimizer([params], opt_cfg(0, "fused", "bfloat16"))
    assert optimizer._step_supports_amp_scaling
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    optimizer.step()
    before = copy.deepcopy((list(params), optimizer.state_dict()["state"]))
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    after = (list(params), optimizer.state_dict()["state"])
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(before[1][i][k], after[1][i][k]) for i in before[1] for k in before[1][i])

    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    lr = torch.tensor(1e-2)
    for flag in (0.0, 1.0):
        p, m, v, step = torch.randn(50), torch.randn(50).bfloat16(), torch.rand(50).bfloat16(), torch.tensor(3.0)
        grad = torch.randn(50) if flag == 0 else torch.full((50,), float("inf"))
        plain = [t.clone() for t in (p, m, v, step)]
        skippable_tensor_step(p, grad, m, v, step, lr, torch.tensor(flag), torch.tensor(1.0), **hyper)
        if flag == 0:
            adamw_tensor_step(*plain[:1], grad, *plain[1:], lr, **hyper)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v, step), plain))


def test_compiled_form_of_the_stochastic_step_equals_the_eager_one():
    """The fused CUDA kernel's form (`skippable_tensor_step`, the rounding a `kernel_site` tensor, one pass)
    traced by dynamo into one graph for every size and gradient divisor (aot_eager here; inductor on CUDA in the
    cuda test) stores the moments bit for bit as the eager step (base an int, int32 chunks), from a global index
    past 2^32 on."""
    from torch._dynamo.utils import counters

    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(skippable_tensor_step, dynamic=True, fullgraph=True, backend="aot_eager")
    key, base = torch.tensor(123456789), 2 ** 32 - 500
    for n in (1000, CHUNK_ELEMENTS + 9, 3000):
        gen = torch.Generator().manual_seed(n)
        p, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen).bfloat16(), torch.rand(n, generator=gen).bfloat16()
        eager = [t.clone() for t in (p, m, v)] + [torch.tensor(4.0)]
        step = torch.tensor(4.0)
        scale = torch.tensor(float(n % 3 + 1))  # the clipping's divisor: 1 is the default
        compiled(p, grad, m, v, step, torch.tensor(1e-2), torch.tensor(0.0), scale,
                 rounding=torch.tensor(kernel_site(int(key), base)), **hyper)
        adamw_tensor_step(eager[0], grad, *eager[1:], torch.tensor(1e-2), rounding=(key, base), grad_scale=scale,
                          **hyper)
        assert torch.equal(m, eager[1]) and torch.equal(v, eager[2]) and torch.equal(step, eager[3])
        torch.testing.assert_close(p, eager[0], rtol=0, atol=1e-6)  # decompositions may differ in the last bit
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_clipping_by_the_optimizers_division_equals_clipping_in_place(monkeypatch, state_dtype):
    """Gradients 50x over `max_norm`: dividing them by `clip_grad_scale` inside the step (torch's fused AdamW; the
    compiled BF16-moment step, here through aot_eager) updates as clipping them in place first does, up to float32
    rounding (a division where clipping multiplies; the first moment's cancellations make that 1e-10 absolute), and
    the moments to within a bfloat16 step (a last-bit difference can flip a stochastic rounding). The compiled step
    leaves the gradients undivided."""
    import trainer.optimizer as optimizer_module
    from parallelisms.clip import clip_grad_norm_, clip_grad_scale, global_grad_norm

    torch._dynamo.reset()
    monkeypatch.setattr(optimizer_module, "_compiles", lambda device: True)
    monkeypatch.setattr(optimizer_module, "_compiled_tensor_step", functools.cache(
        lambda: torch.compile(skippable_tensor_step, dynamic=True, fullgraph=True, backend="aot_eager")))
    params, grads = _tensors()
    twins = copy.deepcopy(params)
    in_place, in_kernel = (build_optimizer([ps], opt_cfg(0, "fused", state_dtype)) for ps in (params, twins))
    assert grad_scale_in_kernel(in_kernel)
    for step_grads in grads[:3]:
        for p, q, g in zip(params, twins, step_grads):
            p.grad, q.grad = g * 50, g * 50
        norm = clip_grad_norm_(list(params), 1.0)
        in_kernel.grad_scale = clip_grad_scale(global_grad_norm(list(twins)), 1.0)
        assert in_kernel.grad_scale.item() == pytest.approx(norm.item(), rel=1e-6) and norm > 10
        for opt in (in_place, in_kernel):
            opt.found_inf = torch.zeros(())
            opt.step()
        if state_dtype == "bfloat16":  # not written back
            assert all(torch.equal(q.grad, g * 50) for q, g in zip(twins, step_grads))
    for p, q in zip(params, twins):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
        for key in MOMENTS:
            torch.testing.assert_close(in_kernel.state[q][key].float(), in_place.state[p][key].float(),
                                       rtol=2 ** -7 if state_dtype == "bfloat16" else 1e-5, atol=1e-9)


def _step_both(eager, step_other, params, twins, grads) -> None:
    """Each step's gradients into both parameter lists (the twins' on their device), then a step of each."""
    for step_grads in grads:
        for p, q, g in zip(params, twins, step_grads):
            p.grad, q.grad = g.clone(), g.to(q.device, copy=True)
        eager.step()
        step_other()


def test_fused_step_compiles_one_graph_for_every_parameter(monkeypatch):
    """The fused implementation's compiled kernel, here on CPU through aot_eager (dynamo's guards, and so its
    recompiles, are the backend's concern no more than the device's): one graph for every parameter shape and step,
    a second for 1-element tensors, and the moments the eager step stores. The 1-D views handed to it once
    recompiled for each rank of the parameters (dynamo guards on a view's base), which an H200 found."""
    import trainer.optimizer as optimizer_module
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled_step = torch.compile(skippable_tensor_step, dynamic=True, fullgraph=True, backend="aot_eager")
    params, grads = _tensors()
    twins = copy.deepcopy(params)
    cfg = opt_cfg(0, "fused", "bfloat16")
    eager, compiled = build_optimizer([params], cfg), build_optimizer([twins], cfg)

    def compiled_on_cpu():
        with monkeypatch.context() as patch:
            patch.setattr(optimizer_module, "_compiles", lambda device: True)
            patch.setattr(optimizer_module, "_compiled_tensor_step", lambda: compiled_step)
            compiled.step()

    counters.clear()
    _step_both(eager, compiled_on_cpu, params, twins, grads)
    assert counters["stats"]["unique_graphs"] == 2  # SHAPES holds a 1-element parameter
    for p, q in zip(params, twins):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=1e-6)
        for key in MOMENTS:
            assert torch.equal(compiled.state[q][key], eager.state[p][key])


@pytest.mark.cuda
def test_cuda_compiled_bf16_step_matches_the_eager_one_and_compiles_once():
    """The fused step on CUDA is `skippable_tensor_step` compiled (dynamic shapes, lr and step as tensors, the
    stochastic rounding's bits computed in the kernel): equal to the same math run eagerly on CPU up to float32
    rounding (a last-bit difference can flip a stochastic rounding: one bfloat16 step), with the gradients divided
    by a `grad_scale` (the trainer's clipping) in both, one graph (two at most: 1-element tensors) for every tensor
    and step, and found_inf skips inside the kernel."""
    from torch._dynamo.utils import counters

    params, grads = _tensors()
    on_cuda = nn.ParameterList([nn.Parameter(p.detach().cuda()) for p in params])
    cfg = opt_cfg(0, "fused", "bfloat16")
    eager, compiled = build_optimizer([params], cfg), build_optimizer([on_cuda], cfg)
    assert grad_scale_in_kernel(compiled) and not grad_scale_in_kernel(eager)
    eager.grad_scale, compiled.grad_scale = torch.tensor(3.0), torch.tensor(3.0, device="cuda")
    counters.clear()
    _step_both(eager, compiled.step, params, on_cuda, grads)
    assert counters["stats"]["unique_graphs"] <= 2
    for p, q in zip(params, on_cuda):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=0, atol=1e-6)
        for key in MOMENTS:
            torch.testing.assert_close(compiled.state[q][key].cpu().float(), eager.state[p][key].float(),
                                       rtol=2 ** -7, atol=0)
    before = [q.detach().clone() for q in on_cuda]
    for q in on_cuda:
        q.grad = torch.full_like(q, float("nan"))
    compiled.found_inf = torch.ones((), device="cuda")
    compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(before, on_cuda))


def _small_args(tmp_path, *extra):
    """SMALL's config (written into `tmp_path`), batch 2 x 32, deterministic, no validation, no tensorboard."""
    return ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path",
            hf_config_file(SMALL, tmp_path), "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--training.deterministic", "true", "--validation.enable", "false", "--metrics.enable_tensorboard",
            "false", *extra]


def test_bf16_moments_save_what_the_memory_plan_predicts_on_the_small_model(tmp_path):
    """The trainer on tests/small_models.py's SMALL, 2 steps each way under the exact tracker (fused AdamW on CPU).
    The optimizer state shrinks by exactly 4 bytes per parameter. The step's peak moves: float32 peaks in backward,
    bfloat16 at the optimizer step (float32 copies of the largest tensor's moments, 2 MiB, on top of the state and
    every gradient), which the plan models term by term; so the bfloat16 peak must match the plan closely, and the
    saving must match the plan's within its documented accuracy (15%, docs/memory.md), which the float32 backward
    peak's prediction uses up (it over-predicts by 2% here)."""
    measured, planned = {}, {}
    for state_dtype in ("float32", "bfloat16"):
        cfg = load_config(_small_args(tmp_path, "--memory.track", "exact", "--training.steps", "2",
                                      "--optimizer.state_dtype", state_dtype, "--job.dump_folder",
                                      str(tmp_path / state_dtype)))
        planned[state_dtype] = plan(cfg, 1)["ranks"][0]
        trainer = Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))
        history = []
        try:
            trainer.train(history)
        finally:
            trainer.close()
        n_params = sum(p.numel() for p in trainer.model_parts[0].parameters())
        n_tensors = len(list(trainer.model_parts[0].parameters()))
        measured[state_dtype] = (trainer.memory.last_stats.breakdown["optimizer_state"],
                                 round(history[-1]["memory/peak_allocated_GiB"] * 2 ** 30))
    (state32, peak32), (state16, peak16) = measured["float32"], measured["bfloat16"]
    plan32, plan16 = planned["float32"], planned["bfloat16"]
    # less the bfloat16 optimizer's 0-d learning rate and each parameter's 0-d int64 key of its rounding
    assert state32 - state16 == 4 * n_params - FLOAT_BYTES - 8 * n_tensors
    assert plan32["optimizer_state_bytes"] - plan16["optimizer_state_bytes"] == 4 * n_params
    assert (plan32["peak_phase"], plan16["peak_phase"]) == ("backward_layer_1", "optimizer_step")
    # what the plan leaves out at the optimizer step: 0-d tensors (step counters, lr, bias corrections, the loss)
    assert 0 <= peak16 - plan16["predicted_peak_bytes"] < 4096
    predicted_saving = plan32["predicted_peak_bytes"] - plan16["predicted_peak_bytes"]
    assert abs((peak32 - peak16) / predicted_saving - 1) < 0.15, (peak32 - peak16, predicted_saving)
    # the step-time model's optimizer traffic: AdamW's 28 bytes per parameter, 20 with bfloat16 moments, plus
    # clipping's: the norm's read, then fused float32 AdamW's write-back of the divided gradients (8), in place on
    # CPU with bfloat16 moments (their step is not compiled there: 12)
    assert (plan32["work"]["optimizer_bytes_per_param"], plan16["work"]["optimizer_bytes_per_param"]) == (36, 32)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_the_step_time_models_clipping_traffic_follows_the_trainers_choice(tmp_path, implementation, state_dtype):
    """The plan's optimizer traffic counts clipping as the trainer runs it on CPU: the norm's read (4 bytes per
    parameter), then a read and write in place (8), or only fused AdamW's write-back (4) where the trainer clips by
    the optimizer's division; none of it without clipping. On CUDA the compiled BF16-moment step divides without
    writing back."""
    args = _small_args(tmp_path, "--memory.track", "off", "--optimizer.implementation", implementation,
                       "--optimizer.state_dtype", state_dtype)
    cfg = load_config(args)
    trainer = Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))
    try:
        clip_bytes = 4 + (4 if trainer._clip_in_step else 8)
    finally:
        trainer.close()
    adamw = 28 if state_dtype == "float32" else 20
    assert plan(cfg, 1)["ranks"][0]["work"]["optimizer_bytes_per_param"] == adamw + clip_bytes
    assert plan(load_config(args + ["--training.max_norm", "0"]), 1)["ranks"][0]["work"][
        "optimizer_bytes_per_param"] == adamw
    in_kernel_on_cuda = implementation == "fused" and state_dtype == "bfloat16"
    assert plan(cfg, 1, device="cuda")["ranks"][0]["work"]["optimizer_bytes_per_param"] == adamw + 4 + (
        0 if in_kernel_on_cuda else clip_bytes - 4)


def test_trainer_clips_inside_the_fused_step_as_clipping_in_place_does(tmp_path):
    """With fused AdamW the trainer clips by the optimizer's division (`grad_scale`, no pass of its own); SMALL with
    a max_norm that clips every step trains as with clipping in place (the trainer's other path, forced here), to
    float32 rounding, and logs the same gradient norms."""
    runs = {}
    for in_step in (True, False):
        cfg = load_config(_small_args(tmp_path, "--memory.track", "off", "--training.steps", "4",
                                      "--training.max_norm", "0.05", "--optimizer.implementation", "fused",
                                      "--job.dump_folder", str(tmp_path / str(in_step))))
        trainer = Trainer(prepare(cfg, world_size=1, rank=0), torch.device("cpu"))
        assert trainer._clip_in_step
        trainer._clip_in_step = in_step
        history = []
        try:
            trainer.train(history)
        finally:
            trainer.close()
        runs[in_step] = ([h[key] for h in history for key in ("loss", "grad_norm")],
                         [p.detach().clone() for p in trainer.model_parts[0].parameters()])
    (logged, params), (logged_ref, params_ref) = runs[True], runs[False]
    assert len(logged) == 8 and all(norm > 0.05 for norm in logged[1::2])
    assert logged == pytest.approx(logged_ref, rel=1e-5)
    for p, q in zip(params, params_ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bf16_moments_loss_curve_stays_within_half_a_percent(tmp_path):
    """CI's short version of benchmarks/bf16_moments.py: SMALL, 30 steps each way from the same seed and data."""
    losses = {}
    for state_dtype in ("float32", "bfloat16"):
        cfg = load_config(_small_args(tmp_path, "--memory.track", "off", "--training.steps", "30",
                                      "--optimizer.state_dtype", state_dtype, "--job.dump_folder",
                                      str(tmp_path / state_dtype)))
        losses[state_dtype] = train_run(cfg)
    rel = [abs(b / a - 1) for a, b in zip(losses["float32"], losses["bfloat16"])]
    assert len(rel) == 30 and losses["bfloat16"][-1] < losses["bfloat16"][0]
    assert 0 < max(rel) < 0.005, rel


@pytest.mark.slow
def test_fsdp2_dcp_resume_converts_state_dtype_both_ways(tmp_path):
    """2 gloo ranks, FSDP2 over both, SMALL: bfloat16 moments are DTensors placed like their parameters; a
    checkpoint of each state dtype resumes into the other, each rank's shards converted exactly (see the worker),
    with one note from rank 0, and training goes on. Stochastic rounding stores the same moments sharded as whole
    (`_rounding_alike_on_a_sharded_layout`)."""
    from dist_utils import launch_json

    jobs = {"args": _small_args(tmp_path, "--memory.track", "off", "--checkpoint.enable", "true",
                                "--checkpoint.interval", "2"), "dump": str(tmp_path)}
    results = launch_json(2, os.path.abspath(__file__), jobs, tmp_path)
    for saved, loaded in (("bfloat16", "float32"), ("float32", "bfloat16")):
        result = results[f"{saved}->{loaded}"]
        assert result["notes"] == [f"optimizer state converted on load: the checkpoint's AdamW moments are {saved}, "
                                   f"this run keeps them in {loaded} (optimizer.state_dtype)"]
        assert result["resumed_at"] == 2 and len(result["losses"]) == 1
        assert result["placements_match"] and result["shards_converted_exactly"]
    assert results["rounding_alike_on_every_layout"]


def _rounding_alike_on_a_sharded_layout() -> bool:
    """On every rank: parameters as DTensors sharded along dim 0 (as FSDP2 and EP shard them; 7 rows, so unevenly)
    and the same parameters whole in one process store the same stochastically rounded moments, shard for shard;
    a parameter sharded along dim 1 is refused in one line naming it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params, grads = _tensors()
    whole = nn.ParameterDict({f"w{i}": p for i, p in enumerate(params)})
    sharded = nn.ParameterDict({name: nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
                                for name, p in whole.items()})
    cfg = opt_cfg(0, "for-loop", "bfloat16")
    opt_whole, opt_sharded = build_optimizer([whole], cfg), build_optimizer([sharded], cfg)
    for step_grads in grads:
        for (name, p), g in zip(whole.items(), step_grads):
            p.grad = g.clone()
            sharded[name].grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        opt_whole.step()
        opt_sharded.step()
    alike = all(torch.equal(opt_sharded.state[sharded[name]][k].full_tensor(), opt_whole.state[p][k])
                for name, p in whole.items() for k in MOMENTS)
    by_columns = nn.ParameterDict({"cols": nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))})
    with pytest.raises(ValueError, match=r"parameter cols is sharded as \(Shard\(dim=1\),\), not along dim 0 only; "
                                         r"allowed with it: nearest"):
        build_optimizer([by_columns], cfg)
    return alike


def _worker(jobs_path: str, out_path: str) -> None:
    """Rank entry point of the 2-rank test: per direction, train 2 steps and save, resume with the other
    state dtype, compare this rank's moment shards with the saved ones, train one more step."""
    import torch.distributed as dist
    from dist_worker import worker_session
    from torch.distributed.tensor import DTensor

    notes = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    trainer_log = logging.getLogger("trainer")
    trainer_log.setLevel(logging.INFO)
    trainer_log.addHandler(handler)

    def trainer(args):
        return Trainer(prepare(load_config(args), dist.get_world_size(), dist.get_rank()), torch.device("cpu"))

    def shards(t):
        named = dict(t.model_parts[0].named_parameters())
        state = t.optimizers[0].state
        placed = all(isinstance(state[p][k], DTensor) and state[p][k].placements == p.placements
                     and state[p][k].device_mesh == p.device_mesh for p in named.values() for k in MOMENTS)
        return {name: {k: state[p][k].to_local().clone() for k in MOMENTS} for name, p in named.items()}, placed

    with worker_session(jobs_path, out_path) as (jobs, results):
        results["rounding_alike_on_every_layout"] = _rounding_alike_on_a_sharded_layout()
        for saved, loaded in (("bfloat16", "float32"), ("float32", "bfloat16")):
            args = jobs["args"] + ["--job.dump_folder", os.path.join(jobs["dump"], saved)]
            first = trainer(args + ["--training.steps", "2", "--optimizer.state_dtype", saved])
            first.train()
            first.close()
            before, placed_before = shards(first)
            notes.clear()
            second = trainer(args + ["--training.steps", "3", "--optimizer.state_dtype", loaded])
            after, placed_after = shards(second)
            exact = all(torch.equal(after[name][k], before[name][k].to(getattr(torch, loaded)))
                        and after[name][k].dtype == getattr(torch, loaded) for name in before for k in MOMENTS)
            assert exact, f"rank {dist.get_rank()}: {saved} -> {loaded} shards differ"
            conversions = [n for n in notes if n.startswith("optimizer state converted")]
            resumed_at = second.start_step
            losses = second.train()
            second.close()
            results[f"{saved}->{loaded}"] = {"notes": conversions, "resumed_at": resumed_at, "losses": losses,
                                             "placements_match": placed_before and placed_after,
                                             "shards_converted_exactly": exact}
            dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
