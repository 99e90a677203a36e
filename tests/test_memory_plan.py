"""trainer.memory_plan: each rank's totals against their parts on the shipped layouts, parameters against the model and
the dry run, the predicted peak against measured ones (in-process and through the check script)."""

import json
import math
import os

import pytest
import torch
from dist_utils import run_cli

from benchmarks import memory_plan_check
from models.deepseek_v3.model import DeepSeekV3Model
from trainer.tools.dry_run import report
from trainer.job_config import load_config, model_job
from trainer.tools.memory_plan import COMPILE_NOTE, main, plan
from trainer.registry import get_model_spec
from trainer.train import Trainer, prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "train_configs")


def _check_plan(result: dict, world_size: int, n_ranks: int) -> None:
    """Each rank's totals against its parts: fp32 AdamW state, the peak as state + the larger of its two phases,
    the named phase and transient the largest ones."""
    assert result["world_size"] == world_size
    assert len(result["ranks"]) == n_ranks
    for r in result["ranks"]:
        assert r["parameter_bytes"] == 4 * r["params"] == r["gradient_bytes"]
        assert r["optimizer_state_bytes"] == 2 * r["parameter_bytes"]
        assert r["predicted_peak_bytes"] == (r["parameter_bytes"] + r["optimizer_state_bytes"] + r["buffer_bytes"]
                                             + max(r["forward_backward_peak_bytes"], r["optimizer_phase_bytes"]))
        if r["optimizer_phase_bytes"] >= r["forward_backward_peak_bytes"]:
            assert r["peak_phase"] == "optimizer_step"
        else:
            assert r["peak_phase"] == r["forward_backward_peak_at"]
        transients = r["transients"]
        assert min(transients.values()) >= 0 and transients[r["largest_transient"]] == max(transients.values())
        assert r["activation_bytes"] > 0


def test_cli_json_one_rank():
    r = run_cli("trainer.memory_plan", ["--config", os.path.join(CONFIGS, "debug_model.toml"), "--ngpu", "1",
                                        "--json", "--training.seq_len", "128"], timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    _check_plan(result, 1, 1)
    rank = result["ranks"][0]
    assert rank["layers"] == list(range(6)) and rank["microbatch"] == [4, 128]
    # one rank holds the whole model: its parameters counted on the meta device
    cfg = load_config(["--job.config_file", os.path.join(CONFIGS, "debug_model.toml")])
    with torch.device("meta"):
        model = DeepSeekV3Model(get_model_spec(cfg.model.name).build_args(model_job(cfg)))
    assert rank["params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("toml, world, n_stages", [("deepseek_v3_16b.toml", 16, 2), ("deepseek_v3_671b.toml", 512, 8)])
def test_large_layouts_match_dry_run(toml, world, n_stages):
    cfg = load_config(["--job.config_file", os.path.join(CONFIGS, toml)])
    result = plan(cfg, world, device="cuda")
    _check_plan(result, world, n_stages)
    dry = report(cfg, world)
    assert [r["parameter_bytes"] for r in result["ranks"]] == [d["param_bytes"] for d in dry]
    assert [r["params"] for r in result["ranks"]] == [d["params"] for d in dry]
    # every layer lives on exactly one stage
    n_layers = get_model_spec(cfg.model.name).build_args(model_job(cfg)).n_layers
    assert sorted(i for r in result["ranks"] for i in r["layers"]) == list(range(n_layers))


@pytest.mark.parametrize("extra", [
    pytest.param([], id="ac_none"),
    # FP8's padded expert rows and its backward's quantised copies (the peak is then a block's backward)
    pytest.param(["--fp8.recipe", "blockwise", "--activation_checkpoint.mode", "full"], id="fp8_blockwise_ac_full",
                 marks=pytest.mark.slow),
])
def test_debug_row_within_15_percent_of_measured(tmp_path, extra):
    """1 rank, batch 4 x 128: the plan against MemoryMonitor's exact peak of a real run."""
    args = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--memory.track", "exact",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
            "--training.local_batch_size", "4", "--training.seq_len", "128", "--training.steps", "2",
            "--job.dump_folder", str(tmp_path), *extra]
    cfg = load_config(args)
    predicted = plan(cfg, 1)["ranks"][0]
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    history = []
    try:
        trainer.train(history)
    finally:
        trainer.close()
    measured = max(h["memory/peak_allocated_GiB"] for h in history) * 2 ** 30
    assert abs(predicted["predicted_peak_bytes"] / measured - 1) <= 0.15, (predicted, measured)
    # at this size the activation phase is the peak, not the optimizer step
    assert predicted["peak_phase"] != "optimizer_step"


def test_fp8_plan_knows_the_recipe():
    """With FP8 experts each expert's rows are padded to multiples of 128 (the plan's expert items grow by E x 127
    rows, and the total to a multiple of 128) and every block's backward working set grows by its largest FP8 GEMM's copies; the
    state (parameters, gradients, AdamW) does not change: checkpoints and the optimizer hold master weights."""
    base = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--training.local_batch_size", "4",
            "--training.seq_len", "128"]
    none = plan(load_config(base), 1)["ranks"][0]
    fp8 = plan(load_config(base + ["--fp8.recipe", "blockwise"]), 1)["ranks"][0]
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert fp8[key] == none[key]
    from models.deepseek_v3.args import FLAVORS

    args = FLAVORS["debugmodel"]
    moe_layers = args.n_layers - args.n_dense_layers
    rows = 4 * 128 * args.n_activated_experts
    padded = -(-(rows + args.n_routed_experts * 127) // 128) * 128 - rows  # each expert + the total to 128 rows
    # padded rows: the experts' input (dim) and the 4 hidden-width tensors kept, plus each row's new position
    per_layer = padded * (args.dim + 4 * args.moe_inter_dim) * 4 + rows * 8
    assert fp8["activation_bytes"] - none["activation_bytes"] == moe_layers * per_layer
    assert fp8["transients"]["backward_working_set"] > none["transients"]["backward_working_set"]


@pytest.mark.parametrize("ranks, ep", [(2, 1), (4, 2)])
def test_fp8_weights_gathered_as_blocks_are_planned_as_the_conversion_wraps_them(ranks, ep):
    """With `fp8.all_gather` each FSDP unit gathers the weights that the runtime conversion wraps (built on the meta
    device: those of the selected modules whose shards hold whole blocks) at 1 byte and a scale per 128 x 128 block
    instead of bf16's 2; the units' elements, and so the gradients reduce-scattered, do not change; the step-time
    work counts the blocks' elements and each rank's shard of them."""
    from models.deepseek_v3.parallelize import MODULE_DEFAULTS, named_blocks
    from quantization.fp8.accounting import FP8_GATHER_BYTES
    from quantization.fp8.config import Fp8Section, fp8_selection
    from quantization.fp8.convert import apply_fp8, apply_fp8_all_gather
    from quantization.fp8.fsdp_all_gather import Fp8GatheredWeight
    from quantization.fp8.kernels import Platform

    base = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--training.dtype", "bfloat16",
            "--fp8.recipe", "blockwise", "--parallelism.expert_parallel_degree", str(ep)]
    on, off = (plan(load_config(base + ["--fp8.all_gather", flag]), ranks)["ranks"][0]["work"]
               for flag in ("true", "false"))
    cfg = load_config(base)
    with torch.device("meta"):
        model = DeepSeekV3Model(get_model_spec(cfg.model.name).build_args(model_job(cfg)))
    apply_fp8(named_blocks(model), fp8_selection(Fp8Section(recipe="blockwise"), MODULE_DEFAULTS), Platform("cpu"))
    apply_fp8_all_gather(model, ranks, ranks // ep, torch.bfloat16)
    layer = model.layers["1"]  # a MoE block: its routed experts are this EP rank's share
    wrapped = sum(p.numel() // (ep if "moe.experts." in n else 1) for n, p in layer.named_parameters()
                  if type(p.data) is Fp8GatheredWeight)
    assert 0 < wrapped < on["fsdp_unit_elements"][1]
    assert on["fsdp_unit_elements"] == off["fsdp_unit_elements"] and off["fp8_gathered_elements"] == 0
    assert off["fsdp_unit_bytes"][1] - on["fsdp_unit_bytes"][1] == 2 * wrapped - math.ceil(wrapped * FP8_GATHER_BYTES)
    n_moe = len(on["fsdp_unit_bytes"]) - 3  # the embedding, the dense block and the head are the others
    dense = sum(p.numel() for p in model.layers["0"].parameters() if type(p.data) is Fp8GatheredWeight)
    assert on["fp8_gathered_elements"] == n_moe * wrapped + dense
    # every wrapped weight sharded over all ranks: the experts' EP share over the ranks EP leaves
    assert ranks * on["fp8_gathered_shard_elements"] == sum(
        p.numel() for p in model.layers.parameters() if type(p.data) is Fp8GatheredWeight)


def test_a_compiled_plan_is_stated_as_an_upper_bound(capsys):
    """The plan models what eager autograd saves; compile saves less (it recomputes pointwise ops), so a compiled
    run's plan says it is an upper bound, in the JSON and in the text, and otherwise equals the eager plan."""
    base = ["--config", os.path.join(CONFIGS, "debug_model.toml"), "--ngpu", "1", "--device", "cpu"]
    main(base + ["--json"])
    eager = json.loads(capsys.readouterr().out)["ranks"][0]
    main(base + ["--json", "--compile.enable", "true"])
    compiled = json.loads(capsys.readouterr().out)["ranks"][0]
    assert not eager["upper_bound"] and COMPILE_NOTE not in eager["notes"]
    assert compiled["upper_bound"] and COMPILE_NOTE in compiled["notes"]
    assert compiled["predicted_peak_bytes"] == eager["predicted_peak_bytes"]
    main(base + ["--compile.enable", "true"])
    assert f"note: {COMPILE_NOTE}" in capsys.readouterr().out


def test_smoke_check_row_against_its_own_numbers(capsys):
    """The check script's smoke row (1 rank, AC none, batch 2 x 128): its ratio and verdict from its two peaks, its
    prediction the plan's for that row."""
    rows = memory_plan_check.run_check(smoke=True)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows
    [row] = rows
    assert (row["ngpu"], row["ac"], row["batch"], row["seq_len"], row["steps"]) == (1, "none", 2, 128, 2)
    cfg = load_config(memory_plan_check.BASE + memory_plan_check.row_args(1, "none", 2, 128, 2))
    predicted = plan(cfg, 1)["ranks"][0]
    assert row["predicted_peak_MiB"] == round(predicted["predicted_peak_bytes"] / 2 ** 20, 2)
    assert row["predicted_phase"] == predicted["peak_phase"]
    assert row["per_rank_measured_MiB"] == [row["measured_peak_MiB"]]
    assert row["ratio"] == pytest.approx(row["predicted_peak_MiB"] / row["measured_peak_MiB"], rel=1e-3)
    assert row["within_15pct"] is True and abs(row["ratio"] - 1) <= 0.15


def test_full_ac_keeps_the_routing_a_deepep_recompute_reuses():
    """With full AC, a DeepEP dispatch's recompute reuses its forward's received top-k ids and weights (int64 and
    fp32 per slot of each received token), so the plan keeps them per MoE block from forward to backward; the
    all-to-all backend keeps only split sizes, and without AC nothing changes."""
    from models.deepseek_v3.args import FLAVORS

    base = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--training.local_batch_size", "4",
            "--training.seq_len", "128", "--parallelism.expert_parallel_degree", "2"]
    ranks = {}
    for mode in ("none", "full"):
        for backend in ("alltoall", "deepep"):
            cfg = load_config(base + ["--activation_checkpoint.mode", mode,
                                      "--parallelism.expert_parallel_comm_backend", backend])
            ranks[mode, backend] = plan(cfg, 2)["ranks"][0]
    args = FLAVORS["debugmodel"]
    tokens, k = 4 * 128, args.n_activated_experts
    received = min(tokens * k, 2 * tokens)  # balanced routing: T * top_k rows, at most every token of both ranks
    per_layer = received * k * (8 + 4)
    moe_layers = args.n_layers - args.n_dense_layers
    none, full = ranks["none", "alltoall"], ranks["full", "alltoall"]
    assert ranks["none", "deepep"]["activation_bytes"] == none["activation_bytes"]
    assert ranks["full", "deepep"]["activation_bytes"] - full["activation_bytes"] == moe_layers * per_layer
    assert full["activation_bytes"] < none["activation_bytes"]


def test_fp8_dispatch_is_planned_at_the_wire_bytes():
    """Blockwise FP8 experts over EP 2 with `fp8.dispatch`: the forward's dispatch at 1 + 4/128 bytes per element
    (both built-in backends send e4m3 rows), the combine and the backward in the compute dtype. Under selective AC
    (the exchanges saved) the all-to-all backend keeps the received e4m3 rows and their scales; DeepEP, whose op
    dequantises them, keeps them in the compute dtype."""
    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.memory_plan import received_rows
    from core.memory_types import Shape
    from quantization.fp8.accounting import FP8_DISPATCH_BYTES

    base = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--training.local_batch_size", "4",
            "--training.seq_len", "128", "--training.dtype", "bfloat16", "--parallelism.expert_parallel_degree", "2",
            "--fp8.recipe", "blockwise", "--activation_checkpoint.mode", "selective"]
    ranks = {(backend, dispatch): plan(load_config(base + ["--parallelism.expert_parallel_comm_backend", backend,
                                                            "--fp8.dispatch", dispatch]), 2)["ranks"][0]
             for backend in ("alltoall", "deepep") for dispatch in ("true", "false")}
    args = FLAVORS["debugmodel"]
    moe_layers = args.n_layers - args.n_dense_layers
    received = received_rows(args, Shape(4, 128, 2, "cpu", 2)) * args.dim  # elements each MoE block receives
    for backend in ("alltoall", "deepep"):
        on, off = ranks[backend, "true"], ranks[backend, "false"]
        assert on["work"]["a2a_grad_bytes"] == off["work"]["a2a_grad_bytes"] > 0
        # forward: dispatch and combine, 2 bytes each without; the dispatch at the wire's bytes with
        assert on["work"]["a2a_bytes"] == pytest.approx(off["work"]["a2a_bytes"] * (FP8_DISPATCH_BYTES + 2) / 4,
                                                        rel=1e-6)
        saved = off["activation_bytes"] - on["activation_bytes"]
        want = moe_layers * (2 * received - math.ceil(FP8_DISPATCH_BYTES * received)) if backend == "alltoall" else 0
        assert saved == want, (backend, saved, want)
    # without FP8 dispatch the plan does not depend on the backend's wire
    assert ranks["alltoall", "false"]["work"]["a2a_bytes"] == ranks["deepep", "false"]["work"]["a2a_bytes"]
