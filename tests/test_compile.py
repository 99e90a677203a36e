"""torch.compile of the DeepSeek-V3 blocks and the loss: no recompiles while routing changes, loss close to eager.

A cold compile is slow on 2 cores (docs/compile.md, "Measured gains"), so each test compiles one small model once
and checks everything on it. Recompiles are counted with dynamo's process-wide counter of compiled graphs
(`counters["stats"]["unique_graphs"]`), read after every step: a recompile of any block or of the loss adds one.

Numerics: under compile the grouped experts run in bf16 even in an fp32 model (the shape function of
`torch._grouped_mm` accepts only bf16), the rest in fp32; see LOSS_RTOL.

Also a rank worker (`tests/dist_utils.launch_json`, or torchrun: `... tests/test_compile.py jobs.json out.json`)
trains each job through the real trainer and records the loss and the number of compiled graphs after every step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

if __name__ == "__main__":  # rank worker: make the repo importable before its modules
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model
from models.deepseek_v3.moe import update_expert_bias
from models.deepseek_v3.parallelize import MODULE_DEFAULTS, checkpoint_model, compile_model, named_blocks
from parallelisms.activation_checkpoint.config import ActivationCheckpointSection
from parallelisms.compile import EAGER_ROUNDINGS, CompileSection, compile_loss, compiled_modules
from quantization.fp8.config import Fp8Section, fp8_selection
from quantization.fp8.convert import apply_fp8
from core.loss import IGNORE_INDEX, count_valid_tokens, cross_entropy_sum
from trainer.compile_times import CompileTimes
from small_models import SMALL, hf_config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ModelArgs(vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=2,
                 max_seq_len=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
COMPILE = CompileSection(enable=True)
BATCH, SEQ, STEPS, WARMUP = 2, 16, 12, 1
# Compiled experts compute in bf16 inside the fp32 model (their output differs by about 0.7% of its largest value).
# At these sizes and inits their share of the residual stream is small: measured loss differences are 1e-7 relative
# (tiny model, 12 steps) and 5e-6 (the debug model, EP=2, 6 steps; the 4-rank test trains SMALL since).
# 1e-3 leaves room for other seeds and platforms.
LOSS_RTOL = 1e-3


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


def _train_tiny(compiled: bool, device: str = "cpu", args: ModelArgs = TINY, fp8: str = "none"
                ) -> tuple[list[float], list[int], list[float]]:
    """12 steps of the tiny model (AC selective per op when compiled: compile(AC(block))) on fresh random tokens,
    with the `fp8` recipe applied first as the parallelize plan does.

    Every step changes the routing (new tokens, expert bias updated), the number of valid labels and so the
    aux-loss gradient scale. Returns per-step losses, compiled-graph counts and routed-token totals.
    """
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    apply_fp8(named_blocks(model), fp8_selection(Fp8Section(recipe=fp8), MODULE_DEFAULTS))
    if compiled:
        checkpoint_model(model, ActivationCheckpointSection(mode="selective"))
        compile_model(model, COMPILE, fp8=fp8 != "none")
    model.to_empty(device=device)
    model.init_weights(buffer_device=torch.device(device), seed=0)
    model.train()
    for moe in model.moe_layers():
        moe.aux_loss_coeff = 1e-2
    loss_fn = compile_loss(cross_entropy_sum, COMPILE) if compiled else cross_entropy_sum
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    losses, graphs, routed = [], [], []
    for step in range(STEPS):
        tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), generator=data).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
        labels[0, : step % 4] = IGNORE_INDEX
        valid = count_valid_tokens(labels).item()
        for moe in model.moe_layers():
            moe.aux_loss_grad_scale = 1.0 / valid
        loss = loss_fn(model(inputs), labels) / valid
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        routed.append(sum(m.tokens_per_expert.sum().item() for m in model.moe_layers()))
        update_expert_bias(model.moe_layers(), coeff=1e-2)
        losses.append(loss.item())
        graphs.append(compiled_graphs())
    if compiled:
        assert compiled_modules(model) == ["layers.0", "layers.1"]
    return losses, graphs, routed


@pytest.mark.slow
def test_compiled_blocks_and_loss_train_without_recompiles():
    eager_losses, _, eager_routed = _train_tiny(compiled=False)
    losses, graphs, routed = _train_tiny(compiled=True)
    # warm-up compiles the dense block, the MoE block and the loss; later steps only run them
    assert graphs[WARMUP:] == [graphs[WARMUP - 1]] * (STEPS - WARMUP), graphs
    assert losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    # tokens are counted once per forward, never again in the compiled backward's recompute
    assert routed == eager_routed == [BATCH * SEQ * TINY.n_activated_experts] * STEPS


# FP8-converted dims multiples of 128 as the blockwise recipe needs (wkv_a, 192 wide, is left out by default); two
# tiles along the hidden size, as in the debug model, where inductor failed on the fused quantisation
TINY_FP8 = ModelArgs(vocab_size=64, dim=256, inter_dim=256, moe_inter_dim=256, n_layers=2, n_dense_layers=1,
                     n_heads=2, max_seq_len=32, n_routed_experts=4, n_shared_experts=1, n_activated_experts=2,
                     kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


@pytest.mark.slow
def test_compiled_fp8_model_trains_like_eager_without_recompiles():
    """A whole model with blockwise FP8 linears and experts compiles (the quantisation is one opaque custom op:
    inductor's CPU code generation failed on the fused block graphs) and trains like eager without recompiles."""
    eager_losses, _, _ = _train_tiny(compiled=False, args=TINY_FP8, fp8="blockwise")
    losses, graphs, routed = _train_tiny(compiled=True, args=TINY_FP8, fp8="blockwise")
    assert graphs[WARMUP:] == [graphs[WARMUP - 1]] * (STEPS - WARMUP), graphs
    # the compiled experts quantise bf16 inputs, eager's fp32 ones: e4m3 roundings flip, and 12 steps at lr 3e-3
    # amplify that (measured: 2e-6 at step 1, 4e-5 and 7e-5 at steps 2-3, then up to 2.9e-3 at step 11)
    assert losses[:3] == pytest.approx(eager_losses[:3], rel=LOSS_RTOL)
    assert losses == pytest.approx(eager_losses, rel=1e-2)
    assert routed == [BATCH * SEQ * TINY_FP8.n_activated_experts] * STEPS


@pytest.mark.cuda
def test_compiled_blocks_and_loss_on_cuda_train_without_recompiles():
    """The same on the GPU (inductor's Triton kernels, the CUDA grouped GEMM): no graph after the first step."""
    eager_losses, _, eager_routed = _train_tiny(compiled=False, device="cuda")
    losses, graphs, routed = _train_tiny(compiled=True, device="cuda")
    assert graphs[WARMUP:] == [graphs[WARMUP - 1]] * (STEPS - WARMUP), graphs
    assert losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    assert routed == eager_routed == [BATCH * SEQ * TINY.n_activated_experts] * STEPS


@pytest.mark.slow
def test_compiled_loss_serves_every_batch_and_sequence_length():
    loss_fn = compile_loss(cross_entropy_sum, COMPILE)
    before = None
    for batch, seq in [(2, 16), (3, 24), (2, 40), (1, 7)]:
        logits = torch.randn(batch, seq, 64, requires_grad=True)
        labels = torch.randint(0, 64, (batch, seq))
        torch.testing.assert_close(loss_fn(logits, labels), cross_entropy_sum(logits, labels))
        if before is None:
            before = compiled_graphs()
    # one graph for all (B, S) with B, S >= 2; a size-1 batch is specialised once
    assert compiled_graphs() - before <= 1


def test_compile_disabled_changes_nothing():
    with torch.device("meta"):
        model = DeepSeekV3Model(TINY)
    off = CompileSection(enable=False)
    assert compiled_modules(compile_model(model, off)) == []
    assert compile_loss(cross_entropy_sum, off) is cross_entropy_sum
    assert compiled_modules(compile_model(model, CompileSection(enable=True, components=["loss"]))) == []


def test_compile_on_a_torch_without_per_call_recompile_limit(monkeypatch):
    """torch 2.11's torch.compile has no `recompile_limit` keyword: apply_compile must not pass it there (it did,
    and `--compile.enable true` failed with a TypeError on the GPU machines' torch 2.11) and must raise dynamo's
    process-wide limit instead, so that per-block graphs still fit."""
    real_compile = torch.compile

    def compile_211(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False):  # torch 2.11.0's signature
        return real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                            options=options, disable=disable)

    monkeypatch.setattr(torch, "compile", compile_211)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with torch.device("meta"):
        model = DeepSeekV3Model(TINY.replace(n_layers=6))
    with torch._dynamo.config.patch(recompile_limit=8):
        compile_model(model, COMPILE)
        assert torch._dynamo.config.recompile_limit == 12  # a training and an eval graph for each of the 6 blocks
    assert len(compiled_modules(model)) == 6


def test_compile_on_torch_2_13_sets_the_limit_per_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")  # the path taken whatever torch runs the test
    with torch.device("meta"):
        model = DeepSeekV3Model(TINY.replace(n_layers=6))
    with torch._dynamo.config.patch(recompile_limit=8):
        compile_model(model, COMPILE)
        assert torch._dynamo.config.recompile_limit == 8  # torch 2.13: per call, the global limit untouched
    assert [c["recompile_limit"] for c in calls] == [12] * 6


def test_fp8_models_compile_with_eager_roundings(monkeypatch):
    """A model that quantises to FP8 compiles with `EAGER_ROUNDINGS` (inductor only: other backends take no
    inductor options); a bf16 model with inductor's defaults."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    for fp8, backend in ((False, "inductor"), (True, "inductor"), (True, "aot_eager")):
        with torch.device("meta"):
            model = DeepSeekV3Model(TINY)
        compile_model(model, CompileSection(enable=True, backend=backend), fp8=fp8)
    assert [c.get("options") for c in calls] == [None] * 2 + [EAGER_ROUNDINGS] * 2 + [None] * 2


@pytest.mark.slow
def test_eager_roundings_make_compiled_fp8_quantisation_give_eager_bits():
    """An fp32 master weight cast to bf16 and quantised in one compiled graph (as an FP8 linear without FSDP does):
    with `EAGER_ROUNDINGS` the e4m3 values and scales are eager's bit for bit. (Without them inductor quantised the
    unrounded fp32 values: 3% of the e4m3 values differed, on this CPU as on an H200.)"""
    from parallelisms.torch_compat import torch_at_least
    from quantization.fp8.quantize import quantize_tiles

    if not torch_at_least(2, 13):
        # measured on torch 2.11.0: 258 of 8192 e4m3 values of a bf16 round trip differ, with the option as without.
        # No CPU training path compiles the quantisation (it stays in the opaque dsv3_fp8::qdq op there), and on CUDA
        # the option held with torch 2.11 (tests/test_fp8_cuda.py, on an H200)
        pytest.skip(f"torch {torch.__version__}'s CPU inductor ignores emulate_precision_casts (2.13's honours it)")
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0)) * 0.02

    def quantize_weight(w):
        return quantize_tiles(w.to(torch.bfloat16), 128, 128)

    want_q, want_s = quantize_weight(w)
    torch._dynamo.reset()
    got_q, got_s = torch.compile(quantize_weight, fullgraph=True, options=EAGER_ROUNDINGS)(w)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_compile_times_log_each_compile_with_its_time(caplog):
    """trainer/compile_times.py: a line per compile, the graph and then its backward (compiled lazily in the first
    backward), with the running count and total; nothing outside its `with`, where torch's callbacks hold it not."""
    fn = torch.compile(lambda x: (x * 2).sin().sum(), backend="aot_eager", fullgraph=True)
    with caplog.at_level(logging.INFO, logger="trainer"):
        with CompileTimes() as times:
            fn(torch.randn(4, requires_grad=True)).backward()
        fn(torch.randn(4, 3, requires_grad=True)).backward()  # a recompile, outside: not counted
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile:")]
    assert len(lines) == times.compiles == 2, lines
    assert re.fullmatch(r"torch\.compile: graph \d+/0 compiled in \d+\.\d s \(1 compiles, \d+\.\d s so far\)", lines[0])
    assert re.fullmatch(r"torch\.compile: backward of graph \d+/0 compiled in \d+\.\d s \(2 compiles, \d+\.\d s so "
                        r"far\)", lines[1])
    assert times.seconds > 0
    assert times._start not in callback_handler.start_callbacks and times._end not in callback_handler.end_callbacks


@pytest.mark.slow
def test_compile_cost_report_traces_the_real_fp8_kernels(capsys):
    """benchmarks/compile_cost.py: the 671B-shape blocks traced with Hopper's FP8 kernels on CPU: every converted
    linear's three GEMMs and the experts' nine are real FP8 GEMM ops in the graphs (not the emulation), none in
    bf16's; the ratios are those of the reported counts."""
    from benchmarks.compile_cost import main

    report = main(["--recipes", "none", "blockwise"])
    assert json.loads(capsys.readouterr().out) == report
    none, blockwise = report["recipes"]["none"], report["recipes"]["blockwise"]
    assert (none["converted"], blockwise["converted"]) == (0, 23)  # as the H200 run's log said
    # dense: 7 linears (wq_a, wq_b, wkv_b, wo, w1, w2, w3); MoE: 4 attention and 3 shared-expert linears, and the
    # routed experts' 3 grouped GEMMs forward, 3 dgrad, 3 wgrad
    assert {k: b["fp8_gemms"] for k, b in blockwise["blocks"].items()} == {"dense": 21, "moe": 4 * 3 + 3 * 3 + 9}
    assert all(b["fp8_gemms"] == 0 and b["forward_ops"] > 0 and b["backward_ops"] > 0 and b["trace_s"] > 0
               for b in none["blocks"].values())
    ops = {r: sum(b["forward_ops"] + b["backward_ops"] for b in v["blocks"].values())
           for r, v in report["recipes"].items()}
    assert report["ops_vs_none"] == {"none": 1.0, "blockwise": ops["blockwise"] / ops["none"]}
    assert ops["blockwise"] > 2 * ops["none"]  # the quantisation of each GEMM's operands


def test_compile_rejects_the_per_expert_loop():
    with torch.device("meta"):
        model = DeepSeekV3Model(TINY.replace(use_grouped_mm=False))
    with pytest.raises(ValueError, match="use_grouped_mm"):
        compile_model(model, COMPILE)


@pytest.mark.slow
def test_compile_gain_smoke_report_against_its_variants(capsys):
    """Two variants (eager, compiled with dynamo's eager backend), one timed step each: dynamo compiled only the
    second, once; the derived numbers and the gains recomputed from the variants' raw ones."""
    from benchmarks import compile_gain

    report = compile_gain.main(["--smoke"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    config = report["config"]
    assert (config["batch"], config["seq_len"], config["steps"], config["warmup"]) == (2, 16, 1, 1)
    eager, compiled = report["variants"]
    assert [(v["dtype"], v["compile"]) for v in (eager, compiled)] == [("float32", False), ("float32", True)]
    assert eager["graphs"] == 0 and eager["compile_s"] == 0.0
    assert compiled["graphs"] > 0 and compiled["recompiles_after_warmup"] == 0
    assert compiled["compile_s"] == pytest.approx(compiled["first_step_s"] - compiled["step_time_s"])
    for v in (eager, compiled):
        assert v["step_times_s"] == [v["step_time_s"]] and v["step_time_s"] > 0
        assert v["tokens_per_s"] == pytest.approx(2 * 16 / v["step_time_s"])
        assert v["step_peak_bytes"] > 0 and 0 < v["steady_peak_rss_bytes"] <= v["process_max_rss_bytes"]
    assert report["gains"] == {"float32": pytest.approx({
        "speedup": eager["step_time_s"] / compiled["step_time_s"],
        "cpu_speedup": eager["step_cpu_s"] / compiled["step_cpu_s"],
        "step_peak_reduction": 1 - compiled["step_peak_bytes"] / eager["step_peak_bytes"],
        "steady_rss_reduction": 1 - compiled["steady_peak_rss_bytes"] / eager["steady_peak_rss_bytes"]})}


# ----------------------------------------------------------------------------------------------- 4 ranks, FSDP x EP

# SMALL (tests/small_models.py), 3 layers (1 dense, 2 MoE): every kind of compiled piece, half the debug model's
# graphs to compile, a tenth of its FSDP/EP traffic
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", hf_config_file(SMALL),
        "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.local_batch_size", "1", "--training.steps", "6",
        "--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "1",
        "--memory.track", "off", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "6",
        "--parallelism.expert_parallel_degree", "2"]


def launch(nproc: int, jobs: dict, tmp_path) -> dict:
    """Run `jobs` ({name: extra args}) in one launch of this file on `nproc` ranks; rank 0's results by job name."""
    from dist_utils import launch_json

    jobs = {name: BASE + ["--job.dump_folder", str(tmp_path / name)] + args for name, args in jobs.items()}
    return launch_json(nproc, os.path.abspath(__file__), jobs, tmp_path)


@pytest.mark.slow
def test_four_ranks_sharded_experts_compiled_with_ac_through_the_trainer(tmp_path):
    """FSDP 4 x EP 2 with the all-to-all dispatcher (each rank's experts FSDP-sharded over 2 ranks, resharded after
    forward): the MoE blocks compile around the dispatcher's host sync, under full and selective AC, whose eager
    checkpoints wrap the compiled pieces (tests/test_ac_matrix.py checks the eager run against one process).

    Validation (eval mode, no_grad) runs after steps 3 and 6: the first one compiles the eval graphs once.
    """
    compiled = ["--compile.enable", "true", "--activation_checkpoint.mode"]
    results = launch(4, {"eager": [], "compiled_full_ac": compiled + ["full"],
                         "compiled_selective_ac": compiled + ["selective"]}, tmp_path)
    for name in ("compiled_full_ac", "compiled_selective_ac"):
        assert_compiled_around_dispatcher_like_eager(results["eager"], results[name])


@pytest.mark.slow
def test_four_ranks_fp8_experts_gathered_as_blocks_compile(tmp_path):
    """The same layout with the blockwise recipe: FSDP gathers the routed experts' weights (DTensors over EP) as
    e4m3 blocks (`fp8.all_gather`), and the compiled experts take the gathered tensor subclass as a graph input,
    without recompiles, with eager's losses; and with the losses of gathering the fp32 weights, bit for bit (the
    compiled experts compute in bf16: the shards are quantised from their bf16 copies, as the GEMMs quantise)."""
    fp8, compiled = ["--fp8.recipe", "blockwise"], ["--compile.enable", "true"]
    results = launch(4, {"eager": fp8, "compiled": fp8 + compiled,
                         "compiled_gather_off": fp8 + compiled + ["--fp8.all_gather", "false"]}, tmp_path)
    assert_compiled_around_dispatcher_like_eager(results["eager"], results["compiled"])
    for key in ("loss", "validation/loss"):
        assert results["compiled"][key] == results["compiled_gather_off"][key]


def assert_compiled_around_dispatcher_like_eager(eager: dict, compiled: dict) -> None:
    """The worker's results of the EP test: pieces compiled, no recompile after warm-up, losses as in eager."""
    modules = [name.replace("_checkpoint_wrapped_module.", "") for name in compiled["compiled_modules"]]
    assert modules, "the trainer did not compile the model (apply_compile not called)"
    # the trainer's compile times: nothing compiled in eager; in a compiled job at least a forward and a backward
    # (graphs that an earlier job of the launch compiled are reused: 13 compiles in the first, 3 in the second)
    assert eager["compile_times"] == [0, 0.0]
    compiles, seconds = compiled["compile_times"]
    assert compiles >= 2 and seconds > 0, compiled["compile_times"]
    assert {"layers.0", "layers.1.attention", "layers.1.moe.router", "layers.1.moe.experts",
            "layers.1.moe.shared_experts"} <= set(modules), modules
    # counted after each train step: validation runs after steps 3 and 6, so its graphs show from step 4 on
    graphs = compiled["graphs"] + [compiled["graphs_at_end"]]
    assert graphs[:3] == [graphs[0]] * 3 and graphs[3:] == [graphs[3]] * 4, graphs
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=LOSS_RTOL)
    assert compiled["validation/loss"] == pytest.approx(eager["validation/loss"], rel=LOSS_RTOL)


def _worker(jobs_path: str, out_path: str) -> None:
    """Rank entry point: train each job through `trainer.train.run`, counting compiled graphs per step."""
    import torch.distributed as dist
    from dist_worker import worker_session

    from trainer.job_config import load_config
    from trainer.train import Trainer, run

    current: dict = {}
    train_step = Trainer.train_step

    def counted_train_step(self, *args, **kwargs):
        scalars = train_step(self, *args, **kwargs)
        current["graphs"].append(compiled_graphs())
        current["compiled_modules"] = compiled_modules(self.model_parts[0])
        current["compile_times"] = [self.compile_times.compiles, self.compile_times.seconds]
        return scalars

    Trainer.train_step = counted_train_step
    # a cold compile on a busy 2-core machine takes minutes
    with worker_session(jobs_path, out_path, timeout_s=600) as (jobs, results):
        for name, args in jobs.items():
            current = results[name] = {"graphs": []}
            history: list[dict] = []
            run(load_config(args), shutdown=False, history=history)
            current["graphs_at_end"] = compiled_graphs()
            current["loss"] = [h["loss"] for h in history]
            current["validation/loss"] = [h["validation/loss"] for h in history if "validation/loss" in h]
            dist.barrier()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
