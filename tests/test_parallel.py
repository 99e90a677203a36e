"""Loss parity of parallel layouts against one process, on gloo CPU ranks (fp32): gradient accumulation,
validation, HSDP, the pipeline schedules, FP8 and the dry run. Every layout crossed with every AC mode and comm
backend is tests/test_ac_matrix.py.

Each launch runs several jobs (tests/dist_worker.py) because a multi-process launch costs seconds on 2 cores.
"""

import os
import subprocess

import pytest
from dist_utils import launch as _launch
from small_models import SMALL, hf_config_file

from trainer.job_config import load_config
from trainer.train import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# global batch of 4 sequences of 32 tokens; same data order whatever the layout. SMALL (tests/small_models.py):
# every piece of a block, at a tenth of the debug model's FSDP/EP traffic, which dominates a step on gloo ranks
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", hf_config_file(SMALL),
        "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.local_batch_size", "1", "--training.steps", "3",
        "--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "1",
        "--memory.track", "off", "--metrics.enable_tensorboard", "false",
        "--training.deterministic", "true"]


def launch(nproc: int, jobs: dict, tmp_path) -> dict:
    return _launch(nproc, jobs, tmp_path, BASE)


@pytest.fixture(scope="module")
def reference(module_tmp_path):
    """One process, the whole global batch in one microbatch: per-step loss, global grad norm, validation loss."""
    tmp = module_tmp_path / "ref"
    history = []
    run(load_config(BASE + ["--job.dump_folder", str(tmp), "--training.local_batch_size", "4"]), history=history)
    return history


PP = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
PP_DP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"]


# fp32 sums over tokens in another order (per rank, then across ranks): losses agree to ~1e-6 relative, the
# global grad norm to ~5e-5 (it mixes many grads with cancellations). A grad scaled by the EP or DP size would be
# off by 2x or more.
TOLERANCE = {"loss": 2e-5, "validation/loss": 2e-5, "grad_norm": 2e-4}


def _assert_parity(results, reference):
    """Same loss, validation loss and global grad norm at every step as one process: expert grads scaled by the EP
    size (DeepSpeed #5618) or averaged instead of summed by FSDP would change the norm of step 1 already."""
    for name, history in results.items():
        for key, rel in TOLERANCE.items():
            got = [h[key] for h in history if key in h]
            want = [h[key] for h in reference if key in h]
            assert len(got) == len(want) and got == pytest.approx(want, rel=rel), (name, key, got, want)


@pytest.mark.slow
def test_two_ranks_fsdp_and_ep(tmp_path, reference):
    results = launch(2, {
        "fsdp2": [],
        "fsdp2_ep2": ["--parallelism.expert_parallel_degree", "2"],
        "fsdp2_ep2_accum": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    }, tmp_path)
    _assert_parity(results, reference)


@pytest.mark.slow
def test_four_ranks_hsdp_fp8_and_interleaved_pipeline(tmp_path, reference, fp8_references):
    results = launch(4, {
        "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
        "pp2_fsdp2_interleaved": PP_DP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
        # FP8 composes with HSDP: checked against the FP8 one-process run below
        "hsdp2x2_fp8": FP8 + ["--parallelism.data_parallel_replicate_degree", "2"],
        # the routed experts, split over EP 2, FSDP-sharded over the 2 ranks left and gathered as e4m3 blocks (on
        # by default), against gathering them in the param dtype: the same bits
        "fsdp4_ep2_fp8": FP8 + ["--parallelism.expert_parallel_degree", "2"],
        "fsdp4_ep2_fp8_gather_off": FP8 + ["--parallelism.expert_parallel_degree", "2", "--fp8.all_gather", "false"],
        # a pipeline keeps every unit gathered from the forward to the backward (no resharding after forward)
        "pp2_fsdp2_fp8": FP8 + PP_DP2,
        "pp2_fsdp2_fp8_gather_off": FP8 + PP_DP2 + ["--fp8.all_gather", "false"],
    }, tmp_path)
    for name in ("fsdp4_ep2_fp8", "pp2_fsdp2_fp8"):
        assert results.pop(f"{name}_gather_off") == results[name], name
    _assert_fp8_parity({name: results.pop(name) for name in ("hsdp2x2_fp8", "fsdp4_ep2_fp8", "pp2_fsdp2_fp8")},
                       fp8_references["blockwise"])
    _assert_parity(results, reference)


@pytest.mark.slow
def test_two_ranks_pipeline_schedules(tmp_path, reference):
    from parallelisms.pipeline import schedule_problem

    # on torch 2.11 the V-shaped ones are refused on CPU before launch (tests/test_bad_inputs.py)
    jobs = {name: PP + ["--parallelism.pipeline_parallel_schedule", name]
            for name in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
            if schedule_problem(name, "cpu") is None}
    _assert_parity(launch(2, jobs, tmp_path), reference)


def _sharding(row: dict, suffix: str) -> list[int] | None:
    """Local shape of the sharding example named `*suffix` in a dry-run row, or None."""
    return next((e["local_shape"] for e in row["shardings"] if e["example"].endswith(suffix)), None)


@pytest.mark.slow
def test_dry_run_16b_on_16_and_671b_on_512(capsys):
    from trainer.tools.dry_run import report

    cfg16 = load_config(["--job.config_file", "train_configs/deepseek_v3_16b.toml"])
    rows = report(cfg16, 16)
    assert [r["rank"] for r in rows] == [0, 8]  # one rank per pipeline stage
    # 64 experts over ep=8: 8 local experts; every rank of a stage holds 1/8 of its dense weights
    assert all(_sharding(r, "experts.w1") == [8, 1408, 2048] for r in rows)
    assert _sharding(rows[0], "tok_embeddings.weight") == [102400 // 8, 2048]
    assert rows[0]["stages"] == ["tok_embeddings layers.0-13"] and rows[1]["stages"] == ["layers.14-26 norm output"]
    from models.deepseek_v3.flops import count_params
    from models.deepseek_v3.args import FLAVORS
    total = count_params(FLAVORS["16B"]).total
    assert sum(r["params"] for r in rows) * 8 == pytest.approx(total, rel=0.01)

    cfg671 = load_config(["--job.config_file", "train_configs/deepseek_v3_671b.toml"])
    rows = report(cfg671, 512)
    assert len(rows) == 8 and rows[-1]["rank"] == 448
    # 256 experts / ep 32 = 8 per EP rank, FSDP-sharded again over efsdp = 64 / 32 = 2
    assert all(_sharding(r, "experts.w1") == [4, 2048, 7168] for r in rows)
    assert sum(r["params"] for r in rows) * 64 == pytest.approx(count_params(FLAVORS["671B"]).total, rel=0.01)


def test_dry_run_through_run_train_sh(tmp_path):
    r = subprocess.run(["./run_train.sh", "--parallelism.dry_run", "true", "--job.dump_folder", str(tmp_path / "d")],
                       cwd=REPO, env=dict(os.environ, NGPU="16", CONFIG_FILE="train_configs/deepseek_v3_16b.toml"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "rank     8" in r.stdout and "AdamW" in r.stdout
    assert not (tmp_path / "d").exists()


FP8 = ["--fp8.recipe", "blockwise"]
CHECKPOINT_AT_2 = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
ROWWISE = ["--fp8.recipe", "rowwise"]


@pytest.fixture(scope="module")
def fp8_references(module_tmp_path):
    """One process per recipe, one sequence per microbatch (gradient accumulation over the 4), as every parallel
    job below runs its microbatches: the weight gradients' token tiles then hold the same tokens."""
    histories = {}
    for recipe, flags in (("blockwise", FP8), ("rowwise", ROWWISE)):
        tmp = module_tmp_path / f"fp8_ref_{recipe}"
        histories[recipe] = []
        run(load_config(BASE + flags + ["--job.dump_folder", str(tmp)]), history=histories[recipe])
    return histories


# FP8 amplifies the summation-order differences of a layout: a weight that differs in its last fp32 bit can move an
# element across an e4m3 rounding boundary, a jump of up to 2^-3 of that element. Step 1's loss (the same weights,
# quantised per token in forward) still matches tightly; later steps and the gradient norms within what such flips
# and the token tiles of EP explain, far tighter than a gradient scaled by the EP or DP size (2x) would be.
FP8_TOLERANCE = {"loss": 1e-3, "validation/loss": 1e-3, "grad_norm": 1e-2}


def _assert_fp8_parity(results, reference):
    rel = {name: {key: [h[key] / r[key] - 1 for h, r in zip(history, reference) if key in h]
                  for key in FP8_TOLERANCE} for name, history in results.items()}
    for name, history in results.items():
        assert len(history) == len(reference), name
        assert abs(rel[name]["loss"][0]) < 2e-5, rel
        for key, tol in FP8_TOLERANCE.items():
            assert max(abs(d) for d in rel[name][key]) < tol, rel


@pytest.mark.slow
def test_two_ranks_fp8_fsdp_pipeline_and_ep(tmp_path, fp8_references):
    """FP8 composes with FSDP2, pipeline parallelism and EP: loss parity with one process with the same recipe.
    FSDP and PP see the same microbatches as the reference; EP gathers the tokens of both ranks' microbatches at
    each expert, so the experts' weight gradients are quantised over other token tiles. The rowwise recipe's
    linears are torchao's Float8Linear, sharded by FSDP2 like any linear."""
    results = launch(2, {
        "fsdp2_fp8": FP8,
        # FSDP gathers the blockwise weights as e4m3 blocks by default (`fp8.all_gather`): the same values as
        # gathering them in the param dtype, so the same losses and gradients bit for bit
        "fsdp2_fp8_gather_off": FP8 + ["--fp8.all_gather", "false"],
        # a checkpoint of a gathered run (its master weights saved as plain tensors) resumes exactly without
        # gathering blocks, and one saved without gathering resumes exactly into the wrapped master weights
        "fsdp2_fp8_saved": {"args": FP8 + CHECKPOINT_AT_2 + ["--job.dump_folder", str(tmp_path / "resumed")],
                            "stop_after": 2},
        "fsdp2_fp8_resumed": FP8 + CHECKPOINT_AT_2 + ["--job.dump_folder", str(tmp_path / "resumed"),
                                                      "--fp8.all_gather", "false"],
        "fsdp2_fp8_saved_plain": {"args": FP8 + CHECKPOINT_AT_2 + ["--job.dump_folder", str(tmp_path / "plain"),
                                                                   "--fp8.all_gather", "false"], "stop_after": 2},
        "fsdp2_fp8_resumed_gathered": FP8 + CHECKPOINT_AT_2 + ["--job.dump_folder", str(tmp_path / "plain")],
        "pp2_fp8": FP8 + ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
        "fsdp2_ep2_fp8": FP8 + ["--parallelism.expert_parallel_degree", "2"],
        "fsdp2_ep2_rowwise": ROWWISE + ["--parallelism.expert_parallel_degree", "2"],
    }, tmp_path)
    assert results.pop("fsdp2_fp8_gather_off") == results["fsdp2_fp8"]
    for saved, resumed in (("fsdp2_fp8_saved", "fsdp2_fp8_resumed"),
                           ("fsdp2_fp8_saved_plain", "fsdp2_fp8_resumed_gathered")):
        assert results.pop(saved) == results["fsdp2_fp8"][:2]
        assert results.pop(resumed) == results["fsdp2_fp8"][2:]
    _assert_fp8_parity({"fsdp2_ep2_rowwise": results.pop("fsdp2_ep2_rowwise")}, fp8_references["rowwise"])
    _assert_fp8_parity(results, fp8_references["blockwise"])
