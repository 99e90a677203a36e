"""Activation checkpointing on every parallel layout: layout x AC mode x comm backend, each against one process.

The matrix (generated below, one launch per world size, the model built once per cell):

    layouts   1 process, fsdp2, fsdp2 x ep2, fsdp4 x ep2, fsdp4 x ep4, hsdp 2x2 x ep2, pp2 x fsdp2, pp2 x fsdp2 x ep2,
              pp2 x fsdp4 x ep2 (8 ranks); context parallel: cp2, cp2 x fsdp2 x ep2 (EP borrows from the
              dp_shard x cp ranks), pp2 x cp2
    AC        none, selective (per-op, default save_ops), full, budget (a choice per layer: see `budget_args`)
    backends  alltoall; and the DeepEP stand-in where EP > 1

Each cell trains 2 steps of a small model (fp32, deterministic) on the same global batch of 8 x 16 tokens and
must give the loss and global grad norm of one process with the same AC mode. Beyond the matrix, on the layouts
whose experts are FSDP-sharded over 2 ranks, where AC used to crash in the first backward, each with selective and
full AC: fsdp4 x ep2 with `fsdp_reshard_after_forward = never`, in bf16 and with the FP8 blockwise recipe;
pp2 x fsdp4 x ep2 with `fsdp_reshard_after_forward = always` (the pipeline default keeps parameters unsharded,
which hid the crash), with the Interleaved1F1B schedule, and in bf16 with selective AC. torch.compile with both AC
modes on fsdp4 x ep2 is in tests/test_compile.py. ZBVZeroBubble and DualPipeV refuse AC in preflight
(tests/test_bad_inputs.py).

Time on the 2-core development machine (torch 2.13.0+cpu, 2026-11-25): about 4 min for the whole file (the 4-rank
launch about 150 s, the 8-rank one about 60 s, the 2-rank one 20 s, the one-process references 4 s), before the
budget cells.
"""

import functools
import itertools

import pytest
from dist_utils import launch as _launch
from small_models import SMALL, hf_config_file

from parallelisms.activation_checkpoint.budget import parse_per_layer
from trainer.job_config import load_config
from trainer.tools.plan import DEFAULT_ROUTING_SKEW, Layout, evaluate, resolve_ac_budget
from trainer.tools.step_time import Hardware
from trainer.train import run

# SMALL (tests/small_models.py): the FSDP/EP traffic that dominates a step on gloo ranks is a tenth of the debug
# model's.
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", hf_config_file(SMALL),
        "--training.seq_len", "16", "--training.global_batch_size", "8", "--training.steps", "2",
        "--validation.enable", "false", "--memory.track", "off", "--metrics.enable_tensorboard", "false",
        "--training.deterministic", "true"]

AC = {
    "none": [],
    "selective": ["--activation_checkpoint.mode", "selective"],
    "full": ["--activation_checkpoint.mode", "full"],
    "budget": None,  # per layout: `budget_args`
}
DEEPEP = ["--parallelism.expert_parallel_comm_backend", "deepep"]
ONE_PROCESS = ["--training.local_batch_size", "8"]
BF16 = ["--training.dtype", "bfloat16"]
FP8 = ["--fp8.recipe", "blockwise", "--training.local_batch_size", "1"]


def _ep(n: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(n)]


def _cp(n: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(n)]


def _pp(local_batch: int) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", str(local_batch)]


#: name -> (ranks, args, EP degree). The local batch is the global batch over the data-parallel degree (no
#: gradient accumulation), so every cell reads the same 8 sequences per step.
LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"], 1),
    "fsdp2_ep2": (2, ["--training.local_batch_size", "4"] + _ep(2), 2),
    "fsdp4_ep2": (4, ["--training.local_batch_size", "2"] + _ep(2), 2),
    "fsdp4_ep4": (4, ["--training.local_batch_size", "2"] + _ep(4), 4),
    "hsdp2x2_ep2": (4, ["--training.local_batch_size", "2", "--parallelism.data_parallel_replicate_degree", "2"]
                    + _ep(2), 2),
    "pp2_fsdp2": (4, _pp(4), 1),
    "pp2_fsdp2_ep2": (4, _pp(4) + _ep(2), 2),
    "pp2_fsdp4_ep2": (8, _pp(2) + _ep(2), 2),
    "cp2": (2, ["--training.local_batch_size", "8"] + _cp(2), 1),
    "cp2_fsdp2_ep2": (4, ["--training.local_batch_size", "4"] + _cp(2) + _ep(2), 2),
    "pp2_cp2": (4, _pp(8) + _cp(2), 1),
}


def _planned_peak_gib(ranks: int, cfg) -> float:
    """The planner's worst-rank peak of a cell's config (the routing skew a launch plans AC mode budget with)."""
    return evaluate(cfg, Layout.of_config(cfg, ranks), ranks, "cpu", DEFAULT_ROUTING_SKEW, Hardware(), {})[
        "predicted_peak_gib"]


@functools.cache
def _budget(ranks: int, args: tuple[str, ...]) -> tuple[str, ...]:
    none, full = (_planned_peak_gib(ranks, load_config([*BASE, *args, "--activation_checkpoint.mode", mode]))
                  for mode in ("none", "full"))
    if none > full * 1.001:
        return "--activation_checkpoint.memory_budget_gib", repr((none + full) / 2)
    # the plan's peak does not depend on AC here (a pipeline stage's peak is its gradients' reduce-scatter at these
    # sizes): a mixed choice given per layer, as a printed config would give it
    exchange = "deepep_dispatch+deepep_combine" if "deepep" in args else "all_to_all"
    return "--activation_checkpoint.per_layer", f"0=full,1=mm+grouped_mm+{exchange},2=none"


def budget_args(ranks: int, args: list[str]) -> list[str]:
    """AC mode budget for the cell of `args` on `ranks`: a budget halfway between the planned peaks of full AC and of
    none (worst rank, the planner's routing skew), so that the choice mixes modes
    (`test_budget_cells_mix_their_choices`); where AC does not move the planned peak, a mixed choice per layer."""
    return ["--activation_checkpoint.mode", "budget", *_budget(ranks, tuple(args))]


def matrix_jobs(nproc: int) -> dict[str, list[str]]:
    """The matrix cells that run on `nproc` ranks: `<layout>/<ac>/<backend>` -> config args."""
    jobs = {}
    for (layout, (ranks, args, ep)), ac in itertools.product(LAYOUTS.items(), AC):
        if ranks != nproc:
            continue
        for backend in ("alltoall", "deepep") if ep > 1 else ("alltoall",):
            cell = args + (DEEPEP if backend == "deepep" else [])
            jobs[f"{layout}/{ac}/{backend}"] = cell + (budget_args(ranks, cell) if ac == "budget" else AC[ac])
    return jobs


def sharded_experts_jobs(nproc: int) -> dict[str, list[str]]:
    """Beyond the matrix, on the layouts whose experts are FSDP-sharded over 2 ranks, with selective and full AC:
    fsdp4 x ep2 (4 ranks) with experts kept unsharded after forward, in bf16 and with FP8 blockwise; pp2 x fsdp4 x
    ep2 (8 ranks) resharding after forward (what crashed without PP; the pipeline default keeps parameters), with
    the Interleaved1F1B schedule, and in bf16 (selective). (Compiled, with both AC modes: tests/test_compile.py,
    against the eager run of the same layout.)"""
    jobs = {}
    if nproc == 4:
        layout = LAYOUTS["fsdp4_ep2"][1]
        for ac in ("selective", "full"):
            jobs[f"fsdp4_ep2/{ac}/reshard_never"] = layout + AC[ac] + ["--parallelism.fsdp_reshard_after_forward",
                                                                        "never"]
            jobs[f"fsdp4_ep2/{ac}/bf16"] = layout + AC[ac] + BF16
            jobs[f"fsdp4_ep2/{ac}/fp8"] = layout + AC[ac] + FP8
    if nproc == 8:
        layout = LAYOUTS["pp2_fsdp4_ep2"][1]
        for ac in ("selective", "full"):
            jobs[f"pp2_fsdp4_ep2/{ac}/reshard_always"] = layout + AC[ac] + [
                "--parallelism.fsdp_reshard_after_forward", "always"]
            jobs[f"pp2_fsdp4_ep2/{ac}/interleaved"] = layout + AC[ac] + [
                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
        jobs["pp2_fsdp4_ep2/selective/bf16"] = layout + AC["selective"] + BF16
    return jobs


def _history(extra: list[str], tmp) -> list[dict]:
    history: list[dict] = []
    run(load_config(BASE + ["--job.dump_folder", str(tmp), "--training.local_batch_size", "8"] + extra),
        history=history)
    return history


@pytest.fixture(scope="module")
def references(module_tmp_path):
    """One process per AC mode (the matrix's "1 process" layout), and without AC in bf16 and with FP8 blockwise
    (whose microbatches are single sequences, like the FP8 cells': its weight gradients' token tiles then match).
    The bf16 and FP8 cells of every AC mode are held against those: a recompute replays the same ops on the same
    inputs, so one process gives the same numbers in every AC mode (`test_one_process_ac_modes_agree`, bit for
    bit)."""
    refs = {ac: _history(args if args is not None else budget_args(1, ONE_PROCESS), module_tmp_path / f"ref_{ac}")
            for ac, args in AC.items()}
    refs["bf16"] = _history(BF16, module_tmp_path / "ref_bf16")
    refs["fp8"] = _history(FP8, module_tmp_path / "ref_fp8")
    return refs


def launch(nproc: int, jobs: dict, tmp_path) -> dict:
    return _launch(nproc, jobs, tmp_path, BASE)


#: fp32: the same tolerance as tests/test_parallel.py (sums over tokens in another order). bf16: every layout rounds
#: its partial sums (per rank, per microbatch) to bf16 at other points. FP8: see tests/test_parallel.py.
TOLERANCE = {
    "fp32": {"loss": 2e-5, "grad_norm": 2e-4},
    "bf16": {"loss": 2e-2, "grad_norm": 5e-2},
    "fp8": {"loss": 1e-3, "grad_norm": 1e-2},
}


def _reference_key(cell: str) -> tuple[str, str]:
    """(reference name, tolerance name) of a job name `<layout>/<ac>/<variant>`."""
    _, ac, variant = cell.split("/")
    if variant in ("bf16", "fp8"):
        return variant, variant
    return ac, "fp32"


def assert_cells_match(results: dict, references: dict) -> None:
    """Every cell trained every step, with the loss and grad norm of one process with the same AC mode."""
    failures = []
    for cell, history in results.items():
        ref_name, tol_name = _reference_key(cell)
        want = references[ref_name]
        for key, rel in TOLERANCE[tol_name].items():
            got = [h[key] for h in history]
            expected = [h[key] for h in want]
            if len(got) != len(expected) or got != pytest.approx(expected, rel=rel):
                failures.append(f"{cell} {key}: {got} vs one process {expected}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_one_process_ac_modes_agree(references):
    """The "1 process" row: AC changes what is kept, never the numbers (a recompute replays the same ops on the
    same inputs): the same losses and grad norms, bit for bit."""
    for ac in ("selective", "full", "budget"):
        for key in ("loss", "grad_norm"):
            assert [h[key] for h in references[ac]] == [h[key] for h in references["none"]], (ac, key)


@pytest.mark.slow
def test_two_ranks_matrix(tmp_path, references):
    jobs = matrix_jobs(2)
    assert len(jobs) == 4 + 4 * 2 + 4
    assert_cells_match(launch(2, jobs, tmp_path), references)


@pytest.mark.slow
def test_four_ranks_matrix_and_sharded_experts(tmp_path, references):
    jobs = matrix_jobs(4) | sharded_experts_jobs(4)
    assert len(jobs) == 5 * 4 * 2 + 2 * 4 + 2 * 3
    assert_cells_match(launch(4, jobs, tmp_path), references)


@pytest.mark.slow
def test_eight_ranks_pipeline_with_sharded_experts(tmp_path, references):
    jobs = matrix_jobs(8) | sharded_experts_jobs(8)
    assert len(jobs) == 4 * 2 + 2 * 2 + 1
    assert_cells_match(launch(8, jobs, tmp_path), references)


def test_budget_cells_mix_their_choices():
    """Every budget cell (and the one-process reference) runs a choice that mixes modes: at least two different
    choices over its 3 layers, as the launch resolves it (`resolve_ac_budget`); and a budget halfway between full's
    and none's planned peaks plans a peak within it."""
    cells = {name: (LAYOUTS[name.split("/")[0]][0], args) for nproc in (2, 4, 8)
             for name, args in matrix_jobs(nproc).items() if "/budget/" in name}
    cells["one_process"] = (1, ONE_PROCESS + budget_args(1, ONE_PROCESS))
    assert len(cells) == 7 * 2 + 4 + 1  # 7 layouts with EP (both backends), 4 without, one process
    for name, (ranks, args) in cells.items():
        cfg, lines = resolve_ac_budget(load_config(BASE + args), ranks, 64.0, "cpu")
        choices = parse_per_layer(cfg.activation_checkpoint.per_layer)
        assert sorted(choices) == [0, 1, 2] and len(set(choices.values())) >= 2, (name, lines)
        if "--activation_checkpoint.memory_budget_gib" in args:
            assert _planned_peak_gib(ranks, cfg) <= cfg.activation_checkpoint.memory_budget_gib, name


def test_mission_layout_dry_run_with_deepep_and_selective_ac():
    """The mission's NGPU=16 layout (PP 2 x FSDP 8 x EP 4, DeepEP, selective AC) passes every check and plans both
    stages: experts split 4-way by EP and FSDP-sharded 2-way, with AC applied (the dry run builds the real wrappers)."""
    from trainer.tools.dry_run import report

    cfg = load_config(["--job.config_file", "train_configs/deepseek_v3_16b.toml",
                       "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "8",
                       "--parallelism.expert_parallel_degree", "4",
                       "--parallelism.expert_parallel_comm_backend", "deepep",
                       "--activation_checkpoint.mode", "selective"])
    rows = report(cfg, 16)
    assert [r["rank"] for r in rows] == [0, 8]
    # every block of each stage is wrapped: the 16B flavor's 27 layers over the two stages
    assert sum(r["checkpointed_blocks"] for r in rows) == 27, [r["checkpointed_blocks"] for r in rows]
    for row in rows:
        assert row["checkpointed_blocks"] > 0
        experts = next(e for e in row["shardings"] if e["example"].endswith("experts.w1"))
        # 64 experts / EP 4 = 16 per rank, each FSDP-sharded over efsdp = 8 / 4 = 2 ranks on dim 0: 8 local rows
        assert experts["local_shape"][0] == 8, experts
