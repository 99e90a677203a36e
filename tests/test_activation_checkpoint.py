"""Activation checkpointing: exact gradients, what backward recomputes, bytes held, name validation, EP collectives.

"Recomputed in backward" is measured as the ops a backward dispatches beyond the same backward without AC
(OpCounter), "held after forward" with torch's exact MemTracker.
"""

import collections
import datetime
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from core import recompute
from core.recompute import RecomputeMemo
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model
from models.deepseek_v3.moe import MoE
from models.deepseek_v3.parallelize import RECOMPUTE_MODULES, checkpoint_model
from parallelisms.activation_checkpoint.config import (ActivationCheckpointSection, ac_config_problem,
                                                       save_ops_warning)
from parallelisms.activation_checkpoint.ops import OpRef
from parallelisms.activation_checkpoint.policy import OpCounter, _sac_contexts, apply_ac
from parallelisms.moe_comm.registry import op_table
from core.config import ConfigError
from trainer.job_config import JobConfig, validate_job

TINY = ModelArgs(vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=2,
                 max_seq_len=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
N_MOE = TINY.n_layers - TINY.n_dense_layers
BATCH, SEQ = 2, 32
WRAPPED = "_checkpoint_wrapped_module."


def ac(**overrides) -> ActivationCheckpointSection:
    return ActivationCheckpointSection(**overrides)


def build(cfg: ActivationCheckpointSection, args: ModelArgs = TINY) -> DeepSeekV3Model:
    """The trainer's order: meta build, parallelize (here: AC only), materialise, init under a fixed seed."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    checkpoint_model(model, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.train()


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def step(model: nn.Module, inputs: torch.Tensor):
    """(loss, grads by unwrapped FQN, ops of the backward by op-table name)."""
    loss = model(inputs).float().pow(2).mean()
    counter = OpCounter()
    with counter:
        loss.backward()
    grads = {n.replace(WRAPPED, ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, counter


def recomputed(counter: OpCounter, baseline: OpCounter, by: str = "kinds") -> dict[str, int]:
    now, before = getattr(counter, by), getattr(baseline, by)
    return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}


@pytest.fixture(scope="module")
def baseline():
    return step(build(ac()), tokens())


def run(cfg, args=TINY):
    return step(build(cfg, args), tokens())


# ----------------------------------------------------------------------------------------------- exactness

CONFIGS = {
    "full": ac(mode="full"),
    "full_early_stop": ac(mode="full", early_stop=True),
    "layer_every_2": ac(mode="selective", granularity="layer", layer_freq=2),
    "op_default": ac(mode="selective"),
    "op_default_early_stop": ac(mode="selective", early_stop=True),
    "op_empty": ac(mode="selective", save_ops=[]),
    "op_force_router": ac(mode="selective", force_recompute_modules=["moe.router"]),
    **{f"megatron_{name}": ac(mode="selective", recompute_modules=[name]) for name in RECOMPUTE_MODULES},
    "megatron_all": ac(mode="selective", recompute_modules=list(RECOMPUTE_MODULES)),
    # mode budget applies each block's own entry (the dense block full, one MoE block per op, one without AC)
    "budget_mixed": ac(mode="budget", per_layer=["0=full", "1=mm+grouped_mm", "2=none"]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_grads_match_no_ac(name, baseline):
    loss, grads, _ = run(CONFIGS[name])
    ref_loss, ref_grads, _ = baseline
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for fqn, g in grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=0, atol=1e-6, msg=fqn)


def test_tokens_are_not_counted_again_in_recompute():
    for cfg in (ac(), ac(mode="full"), ac(mode="selective", recompute_modules=["moe"])):
        model = build(cfg)
        step(model, tokens())
        for moe in model.moe_layers():
            assert moe.tokens_per_expert.sum().item() == BATCH * SEQ * TINY.n_activated_experts


# ----------------------------------------------------------------------------------------------- what is recomputed

def test_full_ac_recomputes_every_compute_op(baseline):
    diff = recomputed(run(ac(mode="full"))[2], baseline[2])
    # per block: q, kv_a, kv_b, o projections + 2 attention bmm; dense FFN 3 mm; MoE gate + shared expert 3 mm
    assert diff["mm"] == 3 * 6 + 3 + N_MOE * 4
    assert diff["grouped_mm"] == 3 * N_MOE
    assert diff["softmax"] == 3 + N_MOE  # attention per block, router per MoE block
    assert diff["topk"] == N_MOE


def test_op_default_saves_mm_and_grouped_mm(baseline):
    diff = recomputed(run(ac(mode="selective"))[2], baseline[2])
    # only the router gate's mm is recomputed: the default force_recompute_modules names it (cheap: dim x E)
    assert diff["mm"] == N_MOE and "grouped_mm" not in diff and "topk" not in diff
    assert diff["silu"] == 1 + 2 * N_MOE and diff["softmax"] == 3 + N_MOE


def test_dtype_casts_are_recomputed_only_host_copies_saved():
    """`d2h_copy` in save_ops saves `_to_copy` only as a copy into host memory: the casts of a bf16 forward
    (autocast's weight copies, int32 offsets) are recomputed like any other cheap op, never held for backward.
    Saving every `_to_copy` held them all, and broke in-place use of a cast's output inside a checkpointed op."""
    casts = {}
    for mode in ("none", "selective"):
        model = build(ac(mode=mode))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the trainer: forward under autocast, backward not
            loss = model(tokens()).float().pow(2).mean()
        counter = OpCounter()
        with counter:
            loss.backward()
        casts[mode] = counter.counts["aten._to_copy.default"]
    # every linear of every block casts its weight to bf16 in forward: recomputed in backward
    assert casts["selective"] - casts["none"] >= 4 * TINY.n_layers


def test_force_recompute_module_overrides_save_ops(baseline):
    diff = recomputed(run(ac(mode="selective", force_recompute_modules=["moe.router"]))[2], baseline[2])
    # the router's gate mm, softmax and topk, and nothing else of the saved kinds
    assert diff["mm"] == N_MOE and diff["topk"] == N_MOE
    assert "grouped_mm" not in diff


def test_toggling_an_op_changes_what_is_recomputed(baseline):
    default = op_table().save_ops(ActivationCheckpointSection().save_ops)
    without_mm = recomputed(run(ac(mode="selective", save_ops=[o for o in default if o != "mm"]))[2], baseline[2])
    assert without_mm["mm"] == 3 * 6 + 3 + N_MOE * 4
    with_softmax = recomputed(run(ac(mode="selective", save_ops=default + ["softmax"]))[2], baseline[2])
    assert "softmax" not in with_softmax


def test_layer_granularity_checkpoints_every_nth_block(baseline):
    diff = recomputed(run(ac(mode="selective", granularity="layer", layer_freq=2))[2], baseline[2])
    assert diff["grouped_mm"] == 3 and diff["topk"] == 1  # block 1 only (a MoE block)
    diff3 = recomputed(run(ac(mode="selective", granularity="layer", layer_freq=3))[2], baseline[2])
    assert diff3["grouped_mm"] == 3 and diff3["mm"] == 6 + 4  # block 2 only


EXPECTED_MEGATRON = {
    # (kinds that must be recomputed with their count, kinds that must not be recomputed)
    "core_attn": ({"mm": 2 * 3, "softmax": 3}, {"grouped_mm", "silu", "topk"}),  # the 2 attention bmm per block
    "mla_up_proj": ({"mm": 3}, {"softmax", "grouped_mm", "silu"}),  # wkv_b (q_lora_rank = 0: no wq_b)
    "moe_act": ({"silu": N_MOE, "mul": N_MOE}, {"mm", "grouped_mm", "softmax", "topk"}),
    "layernorm": ({}, {"mm", "grouped_mm", "silu", "softmax"}),
    "mlp": ({"mm": 3, "silu": 1, "mul": 1}, {"grouped_mm", "softmax", "topk"}),
    "moe": ({"grouped_mm": 3 * N_MOE, "mm": 4 * N_MOE, "topk": N_MOE, "softmax": N_MOE, "silu": 2 * N_MOE}, set()),
    "shared_experts": ({"mm": 3 * N_MOE, "silu": N_MOE}, {"grouped_mm", "topk", "softmax"}),
}


@pytest.mark.parametrize("name", list(RECOMPUTE_MODULES))
def test_megatron_names_recompute_their_ops(name, baseline):
    # without the default forced router-gate recompute, so only the named module's ops show up
    diff = recomputed(run(ac(mode="selective", recompute_modules=[name], force_recompute_modules=[]))[2],
                      baseline[2])
    must, must_not = EXPECTED_MEGATRON[name]
    for kind, n in must.items():
        assert diff.get(kind) == n, (kind, diff)
    assert not must_not & diff.keys(), diff
    assert diff, "something must be recomputed"


def test_mla_up_proj_covers_the_q_up_projection_with_q_lora():
    args = TINY.replace(q_lora_rank=8)
    base = run(ac(), args)[2]
    diff = recomputed(run(ac(mode="selective", recompute_modules=["mla_up_proj"], force_recompute_modules=[]),
                          args)[2], base)
    assert diff["mm"] == 2 * 3  # wq_b and wkv_b in each block


def test_megatron_modules_keep_names_and_attributes():
    plain = build(ac())
    model = build(ac(mode="selective", recompute_modules=list(RECOMPUTE_MODULES)))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    model.moe_layers()[0].aux_loss_grad_scale = 0.5  # the trainer sets this per step; no wrapper may swallow it
    assert model.layers["1"].moe.aux_loss_grad_scale == 0.5


# ----------------------------------------------------------------------------------------------- memory

def held_after_forward(cfg) -> int:
    model = build(cfg)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        loss = model(tokens()).float().pow(2).mean()
        held = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] - before
        loss.backward()
        tracker.reset_mod_stats()
    return held


def test_bytes_held_after_forward_shrink_with_more_recompute():
    none, full = held_after_forward(ac()), held_after_forward(ac(mode="full"))
    default = op_table().save_ops(ActivationCheckpointSection().save_ops)
    selective = held_after_forward(ac(mode="selective"))
    without_grouped_mm = held_after_forward(ac(mode="selective", save_ops=[o for o in default if o != "grouped_mm"]))
    assert none > selective > without_grouped_mm > full
    assert none > held_after_forward(ac(mode="selective", recompute_modules=["moe_act"]))


# ----------------------------------------------------------------------------------------------- names and errors

def test_op_table_resolution():
    assert {torch.ops.aten.mm.default, torch.ops.aten.bmm.default} <= set(op_table().resolve("mm"))
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in op_table().resolve("attention")
    with pytest.raises(ValueError, match="valid names: mm, grouped_mm"):
        op_table().resolve("matmul")


def test_ops_of_a_library_loaded_later_resolve_then():
    ref = OpRef("ac_test_lib.echo.default")
    assert ref.resolve() is None
    lib = torch.library.Library("ac_test_lib", "DEF")
    lib.define("echo(Tensor x) -> Tensor")
    lib.impl("echo", lambda x: x.clone(), "CompositeExplicitAutograd")
    assert ref.resolve() is torch.ops.ac_test_lib.echo.default


def test_op_kind_does_not_resolve_the_table_per_call(monkeypatch):
    # op_kind runs for every op of every EP block under full AC: it reads an index built once
    resolved = []
    resolve = OpRef.resolve
    monkeypatch.setattr(OpRef, "resolve", lambda self: resolved.append(self.name) or resolve(self))
    assert op_table().kind(torch.ops.aten.mm.default) == "mm"
    assert op_table().kind(torch.ops.aten.add.Tensor) is None
    assert resolved == []


def test_d2h_copy_is_any_copy_into_host_memory():
    to_copy = torch.ops.aten._to_copy.default
    on_device = torch.empty(2, device="meta")  # any non-CPU tensor
    assert op_table().kind(to_copy, (on_device,), {"device": torch.device("cpu")}) == "d2h_copy"
    # an explicit copy of a CPU tensor into host memory (`host_list`) stands for the same sync on CPU
    assert op_table().kind(to_copy, (torch.empty(2),), {"device": torch.device("cpu")}) == "d2h_copy"
    assert op_table().kind(to_copy, (on_device,), {"dtype": torch.float16}) is None
    assert op_table().kind(torch.ops.aten._local_scalar_dense.default, (on_device,), {}) == "d2h_copy"


def test_full_ac_of_an_ep_block_saves_split_sizes_and_recomputes_token_rows_fp8_ones_too():
    """The routing-metadata policy of full AC keeps the integer all-to-alls (the split sizes) and the host copies;
    token rows are recomputed, also e4m3 rows, which FP8 dispatch sends as `FP8_WIRE_DTYPE` bytes (before that
    was told apart, full AC kept every MoE block's received e4m3 rows: R x D bytes the plan did not count)."""
    from core.token_dispatch import FP8_WIRE_DTYPE
    from parallelisms.activation_checkpoint.policy import _routing_metadata_policy

    a2a = torch.ops._c10d_functional.all_to_all_single.default

    def policy(op, *args, **kwargs):
        return _routing_metadata_policy(op_table(), None, op, *args, **kwargs)

    def exchange(t):
        return policy(a2a, t, [1, 1], [1, 1], "ep")

    assert exchange(torch.zeros(2, 4, dtype=torch.int64)) == CheckpointPolicy.MUST_SAVE
    assert exchange(torch.zeros(2, 4, dtype=FP8_WIRE_DTYPE)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert exchange(torch.zeros(2, 4)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert exchange(torch.zeros(2, 4, dtype=torch.bfloat16)) == CheckpointPolicy.PREFER_RECOMPUTE
    local_scalar = torch.ops.aten._local_scalar_dense.default
    assert policy(local_scalar, torch.empty((), device="meta")) == CheckpointPolicy.MUST_SAVE
    assert policy(torch.ops.aten.mm.default, torch.zeros(2, 2), torch.zeros(2, 2)) == CheckpointPolicy.PREFER_RECOMPUTE


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown op name 'matmul'.*allowed: default, mm, grouped_mm"):
        checkpoint_model(build(ac()), ac(mode="selective", save_ops=["matmul"]))
    with pytest.raises(ValueError, match="unknown module name 'attn'.*allowed: core_attn, mla_up_proj"):
        checkpoint_model(build(ac()), ac(mode="selective", recompute_modules=["attn"]))
    table = RECOMPUTE_MODULES
    assert ac_config_problem(ac(mode="full", recompute_modules=["moe"]), table)[0] == \
        "activation_checkpoint.recompute_modules"
    assert ac_config_problem(ac(mode="selective", recompute_modules=list(table)), table) is None
    assert ac_config_problem(ac(mode="selective", recompute_modules=["moe"]), table, compile_model=True) is not None
    # another model's table: the names are the model's, not the policy's
    assert ac_config_problem(ac(mode="selective", recompute_modules=["moe"]), {"gate": ()})[2] == "gate"


@pytest.mark.parametrize("key, value, valid", [
    ("save_ops", ["mm", "flash"], ", ".join(["default", *op_table().ops])),
    ("recompute_modules", ["mla"], ", ".join(RECOMPUTE_MODULES)),
])
def test_validate_job_names_the_key_and_the_valid_names(key, value, valid):
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "selective"
    setattr(cfg.activation_checkpoint, key, value)
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, world_size=1)
    assert err.value.key == f"activation_checkpoint.{key}"
    assert err.value.allowed == valid


@pytest.mark.parametrize("overrides, key", [
    (dict(save_ops=["mm", "attention"]), "save_ops"),  # the README's old example: mode stays "none"
    (dict(mode="full", save_ops=["mm"]), "save_ops"),
    (dict(mode="selective", granularity="layer", save_ops=["mm"]), "save_ops"),
    (dict(mode="full", force_recompute_modules=[]), "force_recompute_modules"),
    (dict(mode="selective", granularity="layer", recompute_modules=["moe"]), "recompute_modules"),
    (dict(mode="selective", layer_freq=3), "layer_freq"),
    (dict(mode="full", granularity="layer"), "granularity"),
    (dict(early_stop=True), "early_stop"),
    (dict(mode="full", memory_budget_gib=0.5), "memory_budget_gib"),
    (dict(mode="selective", per_layer=["0=full"]), "per_layer"),
    (dict(mode="budget", save_ops=["mm"]), "save_ops"),
    (dict(mode="budget", granularity="layer"), "granularity"),
])
def test_settings_the_mode_never_reads_are_rejected(overrides, key):
    cfg = JobConfig()
    for name, value in overrides.items():
        setattr(cfg.activation_checkpoint, name, value)
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, world_size=1)
    assert err.value.key == f"activation_checkpoint.{key}"
    assert "would ignore it" in err.value.problem and "unless mode = " in err.value.allowed


@pytest.mark.parametrize("overrides", [
    dict(), dict(mode="full"), dict(mode="full", early_stop=True), dict(mode="selective", granularity="layer"),
    dict(mode="selective", granularity="layer", layer_freq=3), dict(mode="selective", save_ops=["mm"],
                                                                     force_recompute_modules=[], early_stop=True),
    dict(mode="budget", memory_budget_gib=0.5, force_recompute_modules=[], early_stop=True),
    dict(mode="budget", per_layer=["0=none", "1=full", " 2 = mm+all_to_all+topk "]),
])
def test_settings_the_mode_reads_are_accepted(overrides):
    cfg = JobConfig()
    for name, value in overrides.items():
        setattr(cfg.activation_checkpoint, name, value)
    validate_job(cfg, world_size=1)


@pytest.mark.parametrize("per_layer, problem", [
    (["0:full"], "'0:full' is not layer=choice"),
    (["0=full", "0=none"], "layer 0 has two entries"),
    (["0=mm+matmul"], "'matmul' after '=' is neither none, full nor an op name"),
    (["0="], "no choice after '='"),
])
def test_per_layer_entries_that_are_not_layer_equals_choice_are_rejected(per_layer, problem):
    cfg = JobConfig()
    cfg.activation_checkpoint.mode = "budget"
    cfg.activation_checkpoint.per_layer = per_layer
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, world_size=1)
    assert err.value.key == "activation_checkpoint.per_layer"
    assert problem in err.value.problem and "layer=none, layer=full or layer=op+op" in err.value.allowed


def test_budget_gives_each_block_its_own_policy(baseline):
    """Mode budget applies per_layer block by block: layer 0 (dense) fully checkpointed, layer 1 per op saving
    mm and grouped_mm (the router gate's mm recomputed all the same: force_recompute_modules), layer 2 untouched;
    a layer without an entry is an error."""
    model = build(CONFIGS["budget_mixed"])
    assert [type(b).__name__ for b in model.layers.values()] == ["CheckpointWrapper", "CheckpointWrapper",
                                                                   "TransformerBlock"]
    diff = recomputed(step(model, tokens())[2], baseline[2])
    # the dense block: q, kv_a, kv_b, o projections, 2 attention bmm, 3 FFN mm; layer 1: its router gate
    assert diff["mm"] == 6 + 3 + 1
    assert "grouped_mm" not in diff and diff["topk"] == 1
    assert diff["softmax"] == 1 + 2  # the dense block's attention; layer 1's attention and router
    with pytest.raises(ValueError, match=r"per_layer has no entry for layer\(s\) 2"):
        build(ac(mode="budget", per_layer=["0=full", "1=none"]))


def test_apply_ac_leaves_the_settings_of_other_modes_alone():
    """A sweep varies the mode over one section: apply_ac itself checks only names."""
    model = build(ac(mode="full", save_ops=["mm"], layer_freq=3))
    # full mode: every block wrapped (layer_freq is not read)
    assert [type(b).__name__ for b in model.layers.values()] == ["CheckpointWrapper"] * TINY.n_layers


@pytest.mark.parametrize("save_ops, device, dtype, ep, backend, named, like_full", [
    (["attention"], "cpu", "float32", 1, "alltoall", ["attention"], True),
    (["attention", "d2h_copy"], "cpu", "float32", 1, "alltoall", ["attention"], True),
    (["mm", "attention"], "cpu", "float32", 1, "alltoall", ["attention"], False),
    (["mm", "attention", "norm", "all_to_all"], "cpu", "float32", 1, "alltoall", ["attention", "norm", "all_to_all"],
     False),
    (["attention", "all_to_all"], "cpu", "bfloat16", 2, "alltoall", [], False),
    (["attention", "norm"], "cuda", "float32", 1, "alltoall", [], False),
    (["all_to_all", "deepep_dispatch", "deepep_combine"], "cuda", "bfloat16", 2, "alltoall",
     ["deepep_dispatch", "deepep_combine"], False),
    (["deepep_dispatch", "deepep_combine"], "cuda", "bfloat16", 2, "alltoall", ["deepep_dispatch", "deepep_combine"],
     True),
    (["all_to_all", "deepep_dispatch", "deepep_combine"], "cuda", "bfloat16", 2, "deepep", ["all_to_all"], False),
])
def test_save_ops_that_save_nothing_in_the_run_are_named(save_ops, device, dtype, ep, backend, named, like_full):
    warning = save_ops_warning(ac(mode="selective", save_ops=save_ops), device, dtype, ep, backend)
    if not named:
        assert warning is None
        return
    assert warning.startswith("activation_checkpoint.save_ops: ")
    assert {name for name in op_table().ops if f"'{name}' saves nothing here (" in warning} == set(named)
    assert ('as with mode = "full"' in warning) == like_full


def test_save_ops_warning_only_judges_a_list_the_mode_reads_and_the_user_set():
    assert save_ops_warning(ac(mode="selective"), "cpu", "float32", 1, "alltoall") is None  # the default list
    assert save_ops_warning(ac(save_ops=["attention"]), "cpu", "float32", 1, "alltoall") is None  # rejected instead
    assert save_ops_warning(ac(mode="selective", save_ops=["attention"], recompute_modules=["moe"]), "cpu",
                            "float32", 1, "alltoall").endswith(")")  # module-scoped: not "like full AC"


@pytest.mark.parametrize("dtype, fused", [(torch.float32, False), (torch.bfloat16, True)])
def test_attention_rule_matches_the_models_kernel_on_cpu(dtype, fused):
    """The rule behind the 'attention' warning, checked against the model's attention at the debug model's
    head dims (q/k 192, v 128): fp32 on CPU dispatches no op of the 'attention' entry, bf16 does."""
    from models.deepseek_v3.model import attention

    q, k = (torch.randn(1, 2, 16, 192, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 16, 128, dtype=dtype, requires_grad=True)
    with OpCounter() as counter:
        attention(q, k, v, 192 ** -0.5, None).float().sum().backward()
    assert (counter.kinds["attention"] > 0) == fused
    assert (save_ops_warning(ac(mode="selective", save_ops=["mm", "attention"]), "cpu", str(dtype).split(".")[1],
                             1, "alltoall") is None) == fused


# ----------------------------------------------------------------------------------------------- wrapper

def test_wrapper_keeps_state_dict_names_and_forwards_attributes():
    plain, model = build(ac()), build(ac(mode="selective"))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(isinstance(m, MoE) for m in model.moe_layers()) and len(model.moe_layers()) == N_MOE
    assert [layer.moe_enabled for layer in model.layers.values()] == [False, True, True]
    assert type(model.layers["0"]).__name__ == "CheckpointWrapper"


# ----------------------------------------------------------------------------------------------- scopes (toy blocks)

class _Gate(nn.Linear):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("injected")
        return super().forward(x)


class _ToyBlock(nn.Module):
    """proj -> gate (a module) -> SDPA with equal head dims (the fused CPU kernel) -> out; `unused` only lends
    its weight, so its own forward never runs."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d)
        self.gate = _Gate(d, d)
        self.unused = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.proj(x).unflatten(-1, (3, 2, -1)).transpose(1, 3).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        return self.out(a + self.gate(x) + x @ self.unused.weight)


class _ToyModel(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _ToyBlock() for i in range(n)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _toy_backward(cfg) -> OpCounter:
    torch.manual_seed(0)
    model = _ToyModel()
    apply_ac(model.layers, cfg, {})
    x = torch.randn(2, 8, 16)
    out = model(x)
    counter = OpCounter()
    with counter:
        out.backward(torch.ones_like(out))
    return counter


def test_attention_toggle_with_the_fused_cpu_kernel():
    base = _toy_backward(ac())
    saved = recomputed(_toy_backward(ac(mode="selective", save_ops=["mm", "attention"], force_recompute_modules=[])),
                       base)
    dropped = recomputed(_toy_backward(ac(mode="selective", save_ops=["mm"], force_recompute_modules=[])), base)
    assert "attention" not in saved
    assert dropped["attention"] == 2


@pytest.mark.parametrize("early_stop", [False, True])
def test_scope_state_survives_an_exception_and_recompute(early_stop):
    cfg = ac(mode="selective", save_ops=["mm", "attention"], force_recompute_modules=["gate"], early_stop=early_stop)
    torch.manual_seed(0)
    model = _ToyModel()
    apply_ac(model.layers, cfg, {})
    base = _toy_backward(ac())
    gate = model.layers["0"].gate
    gate.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        model(torch.randn(2, 8, 16))
    gate.fail = False
    for _ in range(2):  # a stale "inside gate" mark would make every later op of the block recompute
        out = model(torch.randn(2, 8, 16))
        counter = OpCounter()
        with counter:
            out.backward(torch.ones_like(out))
        diff = recomputed(counter, base, by="counts")
        assert diff.get("aten.addmm.default") == 2  # the gate's linear, once per block
        assert "attention" not in recomputed(counter, base)


def test_module_whose_forward_never_runs_is_reported():
    with pytest.warns(RuntimeWarning, match="'unused' never ran its forward"):
        _toy_backward(ac(mode="selective", force_recompute_modules=["unused"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _toy_backward(ac(mode="selective", force_recompute_modules=["gate"]))


# ----------------------------------------------------------------------------------------------- recompute memo

_PROBE_CALLS: list[tuple[str, int]] = []


@torch.library.custom_op("ac_memo_test::probe", mutates_args=())
def _probe(x: torch.Tensor, tag: int) -> torch.Tensor:
    """Doubles x; records `tag` in a checkpointed forward and reports what its recompute replays (`_PROBE_CALLS`)."""
    got = recompute.replay(("probe", tuple(x.shape)))
    if got is None:
        _PROBE_CALLS.append(("computed", tag))
        recompute.record(("probe", tuple(x.shape)), tag)
    else:
        _PROBE_CALLS.append(("replayed", got))
    return x * 2


_probe.register_autograd(lambda ctx, grad: (grad * 2, None))


def _probe_run(saved_tags: set[int], early_stop: bool = False, backwards: int = 1) -> list[tuple[str, int]]:
    """Three probes (tags 0-2), each followed by a multiplication that saves its output, checkpointed under a SAC
    policy that saves the probes tagged `saved_tags`; checks the gradient against no checkpointing and returns the
    probe calls of the forward and the backward, in order."""
    probe = torch.ops.ac_memo_test.probe.default

    def policy(ctx, op, *args, **kwargs):
        if op is probe and args[1] in saved_tags:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def region(x):
        for tag in range(3):
            x = probe(x, tag) * x
        return x

    x = torch.randn(4, requires_grad=True)
    want = torch.autograd.grad(region(x).sum(), x)[0]
    _PROBE_CALLS.clear()
    out = checkpoint(region, x, use_reentrant=False, early_stop=early_stop, context_fn=lambda: _sac_contexts(policy))
    for _ in range(backwards):
        out.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, want * backwards)
    return list(_PROBE_CALLS)


@pytest.mark.parametrize("early_stop", [False, True])
def test_recompute_memo_replays_what_its_forward_recorded_in_order(early_stop):
    forward = [("computed", tag) for tag in range(3)]
    # everything recomputed: each probe takes its own forward's value, in order
    assert _probe_run(set(), early_stop) == forward + [("replayed", tag) for tag in range(3)]
    # a probe whose output SAC saves does not run again; the others still get their own values, not its
    assert _probe_run({0}, early_stop) == forward + [("replayed", 1), ("replayed", 2)]
    assert _probe_run({1}, early_stop) == forward + [("replayed", 0), ("replayed", 2)]
    assert _probe_run({0, 1, 2}, early_stop) == forward
    # a call recomputed twice (a second backward through a retained graph; SAC allows it when it saved nothing)
    # replays the same values again
    assert _probe_run(set(), early_stop, backwards=2) == forward + [("replayed", tag) for tag in range(3)] * 2


def test_recompute_memo_outside_checkpointing_and_out_of_step():
    # outside a checkpointed call (or under a plain torch checkpoint): nothing recorded, nothing replayed
    recompute.record("key", 1)
    assert recompute.replay("key") is None
    x = torch.randn(3, requires_grad=True)
    _PROBE_CALLS.clear()
    checkpoint(lambda t: torch.ops.ac_memo_test.probe(t, 7) * t, x, use_reentrant=False).sum().backward()
    assert _PROBE_CALLS == [("computed", 7), ("computed", 7)]
    # a recompute that asks for another key than its forward recorded trusts nothing the memo holds
    memo = RecomputeMemo()
    previous = memo.activate(recording=True)
    try:
        for key, value in (("a", 1), ("b", 2)):
            recompute.record(key, value)
            memo.decide(True, op_ran=True)
    finally:
        RecomputeMemo.deactivate(previous)
    previous = memo.activate(recording=False)
    try:
        assert recompute.replay("b") is None and len(memo) == 0 and recompute.replay("b") is None
    finally:
        RecomputeMemo.deactivate(previous)
    assert recompute.replay("a") is None


# ----------------------------------------------------------------------------------------------- SAC invariants

def _ops_in_blocks_forward(model) -> OpCounter:
    counter = OpCounter()

    def enter(*_):
        counter.__enter__()

    def leave(*_):
        counter.__exit__(None, None, None)

    for layer in model.layers.values():
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    model(tokens())
    return counter


def test_forward_and_recompute_dispatch_the_same_savable_ops(baseline):
    """SAC hands saved outputs back by position among the calls of one op: forward-only work (the MoE's token
    counting) must not call an op a policy may save, or a later call would receive another call's output."""
    forward = _ops_in_blocks_forward(build(ac())).counts
    _, _, backward = run(ac(mode="full"))
    again = recomputed(backward, baseline[2], by="counts")
    savable = {str(op) for name in op_table().ops for op in op_table().resolve(name)}
    assert {k: n for k, n in forward.items() if k in savable} == {k: n for k, n in again.items() if k in savable}


# ----------------------------------------------------------------------------------------------- FSDP's runtime

class _LazyUnshard(nn.Module):
    """Stands in for a separately FSDP-sharded submodule (the routed experts under EP): a pre-forward hook labelled
    like FSDP's runtime (`record_function("FSDP::...")`) "all-gathers" its weight (a cat and a matmul, ops a policy
    may save) only when nothing has done it yet, so in forward (where a prefetch did it) and in the recompute (where
    nothing does) the hook dispatches different ops, as FSDP2's does."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.gathered = False
        self.register_forward_pre_hook(self._unshard)

    def _unshard(self, module, args):
        with torch.profiler.record_function("FSDP::pre_forward (experts)"):
            if not self.gathered:
                torch.cat([self.weight.detach()] * 2) @ torch.ones(self.weight.shape[1], 1)
                self.gathered = True

    def forward(self, x):
        return torch.relu(x @ self.weight)


class _UnshardBlock(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.experts = _LazyUnshard(d)

    def forward(self, x):
        return self.inp(x) + self.experts(x)


@pytest.mark.parametrize("mode", ["selective", "full_ep"])
def test_fsdp_runtime_in_a_checkpointed_block_stays_out_of_sac_replay(mode, monkeypatch):
    """Before the bypass this raised `aten.cat.default encountered during backward but not found in storage` (the
    shape of `fsdp.all_gather_copy_in` crashing fsdp4 x ep2 with AC). Now: the same gradients as without AC, and
    the runtime's ops still reach a dispatch mode below the SAC mode (where the memory tracker sits)."""
    from parallelisms.activation_checkpoint import policy as ac_module

    def grads(cfg):
        torch.manual_seed(0)
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": _UnshardBlock()})
        if mode == "full_ep":  # full AC of an EP block runs the routing-metadata SAC policy
            monkeypatch.setattr(ac_module, "_syncs_with_host", lambda block: True)
        apply_ac(model.layers, cfg, {})
        model.layers["0"].experts.gathered = True  # "prefetched" before the forward region
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        below = OpCounter()
        with below:
            out = model.layers["0"](x)
            model.layers["0"].experts.gathered = False  # "resharded after forward": the recompute unshards
            out.sum().backward()
        return [p.grad.clone() for p in model.parameters()], below

    reference, _ = grads(ac())
    got, below = grads(ac(mode="selective", save_ops=["mm"]) if mode == "selective" else ac(mode="full"))
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert below.counts["aten.cat.default"] == 1  # the recompute's "all-gather", seen below the SAC mode


def test_fsdp_runtime_in_the_recompute_leaves_the_policy_unchanged():
    """The bypass keeps what selective AC promises: the backward of a block whose recompute runs FSDP's runtime
    (experts resharded after forward) dispatches exactly the ops of the same backward without it (experts kept
    gathered) plus the runtime's own: the model's saved matmuls are not recomputed, its relu is, in both."""

    def backward_ops(reshard: bool) -> collections.Counter:
        torch.manual_seed(0)
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": _UnshardBlock()})
        apply_ac(model.layers, ac(mode="selective", save_ops=["mm"], force_recompute_modules=[]), {})
        model.layers["0"].experts.gathered = True
        out = model.layers["0"](torch.randn(4, 8))
        model.layers["0"].experts.gathered = not reshard
        counter = OpCounter()
        with counter:
            out.sum().backward()
        return counter.counts

    kept, resharded = backward_ops(reshard=False), backward_ops(reshard=True)
    # exactly the hook's "all-gather": detach, cat, ones, mm
    hook = {"aten.detach.default": 1, "aten.cat.default": 1, "aten.ones.default": 1, "aten.mm.default": 1}
    assert resharded - kept == collections.Counter(hook)
    assert kept - resharded == collections.Counter()
    assert kept["aten.relu.default"] == 1 and kept["aten.addmm.default"] == 0


# ----------------------------------------------------------------------------------------------- 2 ranks, all-to-all

class _Exchange(nn.Module):
    """An equal-split all-to-all with autograd, as the EP dispatcher moves tokens."""

    def forward(self, x):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(x, None, None, dist.group.WORLD)


class _CommBlock(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.comm = _Exchange()
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return self.out(torch.relu(self.comm(self.inp(x))))


def _a2a_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cases = {
            "none": ac(),
            "saved": ac(mode="selective", save_ops=["mm", "all_to_all"], force_recompute_modules=[]),
            "not_saved": ac(mode="selective", save_ops=["mm"], force_recompute_modules=[]),
            "saved_in_forced_module": ac(mode="selective", save_ops=["mm", "all_to_all"],
                                         force_recompute_modules=["comm"]),
            "full": ac(mode="full"),
        }
        result = {}
        for name, cfg in cases.items():
            torch.manual_seed(0)
            model = nn.Module()
            model.layers = nn.ModuleDict({str(i): _CommBlock() for i in range(2)})
            apply_ac(model.layers, cfg, {})
            h = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
            for layer in model.layers.values():
                h = layer(h)
            counter = OpCounter()
            with counter:
                h.pow(2).sum().backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            result[name] = {"a2a": counter.counts["_c10d_functional.all_to_all_single.default"],
                            "grads": grads.tolist()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_saving_all_to_all_avoids_a_second_exchange_in_backward(tmp_path):
    mp.spawn(_a2a_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counts = {name: r["a2a"] for name, r in result.items()}
        # no AC: one backward all-to-all per block; recomputing the exchange adds one per block
        assert counts == {"none": 2, "saved": 2, "not_saved": 4, "saved_in_forced_module": 2, "full": 4}
        for name, r in result.items():
            torch.testing.assert_close(torch.tensor(r["grads"]), torch.tensor(result["none"]["grads"]),
                                       rtol=0, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------------- the sweep

@pytest.mark.slow
def test_sweep_smoke_prints_one_json_row_per_setting(capsys):
    from benchmarks import ac_sweep

    # one row of each kind keeps this quick; every row has the same schema
    rows = ac_sweep.main(["--smoke", "--rows", "full,selective,save_ops-mm,save_ops=[grouped_mm],"
                          "recompute_modules=[moe_act]"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == rows
    assert [r["row"] for r in rows] == ["none", "full", "selective_layer_every_2", "selective_op", "save_ops-mm",
                                        "save_ops=[grouped_mm]", "recompute_modules=[moe_act]"]
    none = rows[0]
    assert [r["mode"] for r in rows] == ["none", "full", "selective", "selective", "selective", "selective",
                                         "selective"]
    for row in rows:
        assert row["peak_bytes"] > 0 and row["step_time_s"] > 0 and row["step_cpu_s"] > 0
        # each *_rel is its row's bytes over the no-AC row's
        for rel, key in (("peak_rel", "peak_bytes"), ("held_rel", "held_after_forward_bytes"),
                         ("activation_rel", "activation_bytes")):
            assert row[rel] == pytest.approx(row[key] / none[key], abs=1e-4), (row["row"], rel)
        assert row["recomputed_total"] == sum(row["recomputed_ops"].values())
    assert none["recomputed_ops"] == {} and (none["peak_rel"], none["time_rel"], none["cpu_rel"]) == (1.0, 1.0, 1.0)
    # full AC keeps less after forward and recomputes matmuls in backward
    assert rows[1]["held_after_forward_bytes"] < none["held_after_forward_bytes"]
    assert rows[1]["recomputed_ops"]["mm"] > 0
    assert "mm" in rows[4]["recomputed_ops"] and "grouped_mm" not in rows[5]["recomputed_ops"]


def test_sweep_rows_cover_every_toggle():
    from benchmarks import ac_sweep

    base = ActivationCheckpointSection()
    names = [name for name, _ in ac_sweep.sweep_settings(base, dispatched={"mm", "grouped_mm", "topk", "silu"},
                                                         recompute_names=list(RECOMPUTE_MODULES))]
    assert names[:4] == ["none", "full", "selective_layer_every_2", "selective_op"]
    assert {"save_ops-mm", "save_ops-grouped_mm", "save_ops-topk", "save_ops=[silu]", "save_ops=[mm]"} <= set(names)
    assert not any("attention" in n or "all_to_all" in n for n in names)  # never dispatched: no rows
    assert {f"recompute_modules=[{n}]" for n in RECOMPUTE_MODULES} <= set(names)


# ----------------------------------------------------------------------------------------------- mode budget, run

def _small_run(tmp_path, name: str, extra: list[str]) -> list[dict]:
    """2 steps of tests/small_models.py's SMALL model in this process (fp32, exact tracking, batch 4 x 128)."""
    from small_models import SMALL, hf_config_file

    from trainer.job_config import load_config
    from trainer.train import run

    history: list[dict] = []
    run(load_config(SMALL_RUN + ["--model.hf_config_path", hf_config_file(SMALL), "--job.dump_folder",
                                 str(tmp_path / name)] + extra), history=history)
    return history


SMALL_RUN = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "128",
             "--training.local_batch_size", "4", "--training.steps", "2", "--memory.track", "exact",
             "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--training.deterministic",
             "true"]


@pytest.mark.slow
def test_budget_holds_measured_and_keeps_the_losses(tmp_path):
    """AC mode budget on the small model, one process, exact tracker: for budgets a third and two thirds of the way
    from full AC's planned peak to none's, the choice mixes modes, the measured peak (the largest over the steps,
    step 2 holding the AdamW state) is within the budget plus the plan's stated error (7%, docs/memory.md),
    and the losses are AC none's, bit for bit."""
    from small_models import SMALL, hf_config_file

    from trainer.job_config import load_config
    from trainer.tools.plan import DEFAULT_ROUTING_SKEW, Layout, evaluate, resolve_ac_budget
    from trainer.tools.step_time import Hardware

    def planned(mode: str) -> float:
        cfg = load_config(SMALL_RUN + ["--model.hf_config_path", hf_config_file(SMALL),
                                       "--activation_checkpoint.mode", mode])
        return evaluate(cfg, Layout.of_config(cfg, 1), 1, "cpu", DEFAULT_ROUTING_SKEW, Hardware(), {})[
            "predicted_peak_gib"]

    low, high = planned("full"), planned("none")
    reference = [h["loss"] for h in _small_run(tmp_path, "none", [])]
    for fraction in (1 / 3, 2 / 3):
        budget = low + fraction * (high - low)
        args = ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget_gib", repr(budget)]
        cfg, lines = resolve_ac_budget(load_config(SMALL_RUN + ["--model.hf_config_path", hf_config_file(SMALL)]
                                                   + args), 1, 64.0, "cpu")
        assert len({e.partition("=")[2] for e in cfg.activation_checkpoint.per_layer}) > 1, lines
        history = _small_run(tmp_path, f"budget_{fraction:.2f}", args)
        peak = max(h["memory/peak_allocated_GiB"] for h in history)
        assert peak <= budget * 1.07, (fraction, peak, budget, lines)
        assert [h["loss"] for h in history] == reference, fraction


@pytest.mark.slow
def test_budget_compiles_each_block_with_its_own_policy():
    """torch.compile of the blocks after mode budget's per-layer AC (two dense blocks, one fully checkpointed, one
    per op, each compiled with its own policy; per-op AC of MoE blocks compiled: tests/test_compile.py): loss and
    gradients as eager without AC, and no recompile on a second step."""
    from torch._dynamo.utils import counters

    from models.deepseek_v3.parallelize import compile_model
    from parallelisms.compile import CompileSection

    dense = TINY.replace(n_layers=2, n_dense_layers=2)
    ref_loss, ref_grads, _ = run(ac(), dense)
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepSeekV3Model(dense)
    checkpoint_model(model, ac(mode="budget", per_layer=["0=full", "1=mm"]))
    compile_model(model, CompileSection(enable=True))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.train()
    loss = model(tokens()).float().pow(2).mean()
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-3, atol=0)
    for fqn, param in model.named_parameters():
        name = fqn.replace(WRAPPED, "").replace("_orig_mod.", "")
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-2, atol=1e-4, msg=name)
    graphs = counters["stats"]["unique_graphs"]
    model.zero_grad(set_to_none=True)
    model(tokens()).float().pow(2).mean().backward()
    assert counters["stats"]["unique_graphs"] == graphs
