"""MoE comm backends register themselves; the config, expert parallelism, activation checkpointing and the train
loop take everything from the registry.

The worked example of docs/architecture.md ("Adding a comm backend") lives here: `AllGatherDispatcher`, a toy
backend registered from this file, trains the debug model on 2 gloo ranks with the losses of the all-to-all
backend. This file is also the rank worker of that check (`python tests/test_comm_backends.py jobs.json
out.json`), so the worker processes register the toy backend the same way. In pytest the toy backend is registered
only while this module's tests run: pytest imports every test module before running any, and a backend left in the
registry would be planned (and chosen by `parallelism.auto`) in other modules' tests, whose workers do not know it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from core.token_dispatch import Dispatched, TokenDispatcher, host_list  # noqa: E402
from parallelisms.moe_comm import registry  # noqa: E402
from parallelisms.moe_comm.registry import COMM_BACKENDS, get_comm_backend, register_comm_backend  # noqa: E402
from parallelisms.activation_checkpoint.config import ActivationCheckpointSection, ac_config_problem  # noqa: E402
from core.config import ConfigError  # noqa: E402
from trainer.job_config import load_config, validate_job  # noqa: E402


# ----------------------------------------------------------------------------------------------- the toy backend

class AllGatherDispatcher(TokenDispatcher):
    """Every rank gathers all tokens of the EP group, keeps the (token, expert) pairs of its own experts, and sends
    the expert outputs home with one reduce-scatter that also sums each token's top-k contributions."""

    padded_rows = False
    #: dispatch calls since the last `metrics()` (what the example's metrics hook reports)
    dispatches = 0

    def __init__(self, group, num_experts: int):
        self.group = group
        ep = dist.get_world_size(group)
        self.num_local_experts = num_experts // ep
        self.first_expert = dist.get_rank(group) * self.num_local_experts

    @classmethod
    def config_problem(cls, parallel_dims, activation_checkpoint, compile):
        if not parallel_dims.ep_enabled:
            return ("parallelism.expert_parallel_comm_backend", "toy_allgather needs expert_parallel_degree > 1",
                    "alltoall with EP = 1")
        return None

    @classmethod
    def metrics(cls):
        count, cls.dispatches = cls.dispatches, 0
        return {"moe/toy_dispatches": float(count)}

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK, num_tokens_per_expert):
        type(self).dispatches += 1
        K, E = topk_idx_TK.shape[1], self.num_local_experts
        # G = tokens of the whole EP group. Every collective is waited at once: left pending on gloo (torch 2.13),
        # these crashed the process (SIGSEGV in wait_tensor) in about 1 run of 5
        x_GD = funcol.wait_tensor(funcol.all_gather_tensor_autograd(x_TD, 0, self.group))
        w_GK = funcol.wait_tensor(funcol.all_gather_tensor_autograd(topk_weights_TK, 0, self.group))
        local_GK = funcol.wait_tensor(funcol.all_gather_tensor(topk_idx_TK, 0, self.group)) - self.first_expert
        # pairs of other ranks' experts sort last (key E) and are cut off
        key = torch.where((local_GK >= 0) & (local_GK < E), local_GK, E).reshape(-1)
        counts_E = torch.bincount(key, minlength=E + 1)[:E]
        (n_rows,) = host_list(counts_E.sum().reshape(1))  # the one host sync: rows this rank keeps
        rows_N = torch.argsort(key, stable=True)[:n_rows]
        token_N = rows_N // K
        weights_N = w_GK.reshape(-1).index_select(0, rows_N)
        return Dispatched(x_GD.index_select(0, token_N), weights_N, counts_E, (token_N, x_GD.shape[0]))

    def combine(self, y_ND, state):
        token_N, num_gathered = state
        y_GD = y_ND.new_zeros(num_gathered, y_ND.shape[1]).index_add_(0, token_N, y_ND)
        return funcol.wait_tensor(funcol.reduce_scatter_tensor_autograd(y_GD, "sum", 0, self.group))


# ----------------------------------------------------------------------------------------------- single process

@pytest.fixture(autouse=True, scope="module")
def toy_backend_registered():
    """The toy backend in the registry for this module's tests only (see the module docstring)."""
    register_comm_backend("toy_allgather")(AllGatherDispatcher)
    yield
    registry._BACKENDS.pop("toy_allgather", None)


@pytest.fixture
def scratch_registry():
    """Undo what a test registers: the backends (the op table is derived from them)."""
    backends = dict(registry._BACKENDS)
    yield
    registry._BACKENDS.clear()
    registry._BACKENDS.update(backends)


def test_config_choices_come_from_the_registry():
    assert {"alltoall", "deepep", "toy_allgather"} <= set(COMM_BACKENDS)
    cfg = load_config(["--parallelism.expert_parallel_comm_backend", "toy_allgather"])
    assert get_comm_backend(cfg.parallelism.expert_parallel_comm_backend) is AllGatherDispatcher
    with pytest.raises(ConfigError, match="'ring' is not a valid choice; allowed: alltoall, deepep, .*toy_allgather"):
        load_config(["--parallelism.expert_parallel_comm_backend", "ring"])


def test_the_backend_validates_the_config():
    cfg = load_config(["--parallelism.expert_parallel_comm_backend", "toy_allgather"])
    with pytest.raises(ConfigError, match="expert_parallel_comm_backend: toy_allgather needs"):
        validate_job(cfg, 1)
    cfg.parallelism.expert_parallel_degree = 2
    assert validate_job(cfg, 2).ep == 2


def test_a_name_is_registered_once(scratch_registry):
    assert register_comm_backend("toy_allgather")(AllGatherDispatcher) is AllGatherDispatcher  # same class: no-op

    class Other(TokenDispatcher):
        pass

    with pytest.raises(ValueError, match="already registered by AllGatherDispatcher"):
        register_comm_backend("toy_allgather")(Other)
    with pytest.raises(TypeError, match="not a TokenDispatcher"):
        register_comm_backend("plain")(object)


def test_backend_ops_join_the_op_table_and_the_default_save_ops(scratch_registry):
    lib = torch.library.Library("toy_comm", "DEF")
    lib.define("send(Tensor x) -> Tensor")
    lib.impl("send", lambda x: x.clone(), "CompositeExplicitAutograd")
    op = torch.ops.toy_comm.send.default
    assert registry.op_table().kind(op) is None

    @register_comm_backend("toy_with_ops")
    class WithOps(TokenDispatcher):
        ac_ops = {"toy_send": ("toy_comm.send.default",)}

    table = registry.op_table()  # derived from the backends registered now
    assert table.kind(op) == "toy_send"
    assert table.resolve("toy_send") == [op] and "toy_send" in table.collectives
    assert "toy_send" in table.save_ops(ActivationCheckpointSection().save_ops)
    assert ac_config_problem(ActivationCheckpointSection(mode="selective", save_ops=["toy_send"]), {}) is None


def test_a_backend_whose_ops_clash_is_not_registered(scratch_registry):
    class Clash(TokenDispatcher):
        ac_ops = {"mm": ("aten.mm.default",)}

    with pytest.raises(ValueError, match="mm already in the activation checkpointing op table"):
        register_comm_backend("clash")(Clash)
    assert "clash" not in COMM_BACKENDS


# ----------------------------------------------------------------------------------------------- 2 ranks

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.steps", "3", "--training.deterministic", "true",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--memory.track", "off",
        "--parallelism.expert_parallel_degree", "2"]
KEYS = ("loss", "grad_norm", "moe/toy_dispatches")


@pytest.mark.slow
def test_toy_backend_trains_like_alltoall(tmp_path):
    from dist_utils import launch_json

    toy = ["--parallelism.expert_parallel_comm_backend", "toy_allgather"]
    jobs = {name: BASE + ["--job.dump_folder", str(tmp_path / name)] + extra for name, extra in {
        "alltoall": [], "toy": toy, "toy_full_ac": toy + ["--activation_checkpoint.mode", "full"]}.items()}
    out = launch_json(2, os.path.abspath(__file__), jobs, tmp_path)
    want = out["alltoall"]
    moe_layers = 5  # debugmodel: 6 blocks, the first dense; one forward per step (one microbatch, no validation)
    for name in ("toy", "toy_full_ac"):
        got = out[name]
        for key, rel in (("loss", 1e-6), ("grad_norm", 1e-5)):
            assert [h[key] for h in got] == pytest.approx([h[key] for h in want], rel=rel), (name, key)
        # the backend's metrics hook reaches the log; full AC's recompute dispatches once more per layer
        per_step = moe_layers * (2 if name == "toy_full_ac" else 1)
        assert [h["moe/toy_dispatches"] for h in got] == [per_step] * len(got), name
    assert all("moe/toy_dispatches" not in h for h in want)


def _worker(jobs_path: str, out_path: str) -> None:
    from dist_worker import worker_session
    from trainer.train import run

    with worker_session(jobs_path, out_path) as (jobs, results):
        for name, args in jobs.items():
            history: list[dict] = []
            run(load_config(args), shutdown=False, history=history)
            results[name] = [{k: h[k] for k in KEYS if k in h} for h in history]
            dist.barrier()


if __name__ == "__main__":
    register_comm_backend("toy_allgather")(AllGatherDispatcher)
    _worker(sys.argv[1], sys.argv[2])
