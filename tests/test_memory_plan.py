"""trainer.memory_plan: JSON schema on the shipped layouts, agreement with the dry run, and one measured row."""

import json
import os
import subprocess
import sys

import pytest

from trainer.job_config import load_config
from trainer.memory_plan import plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "train_configs")

RANK_KEYS = {"rank", "coords", "stages", "layers", "ac_modes", "microbatch", "microbatches_in_flight", "params",
             "parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buffer_bytes", "activation_bytes",
             "transients", "largest_transient", "forward_backward_peak_bytes", "forward_backward_peak_at",
             "optimizer_phase_bytes", "peak_phase", "predicted_peak_bytes", "notes"}
TRANSIENT_KEYS = {"optimizer_step", "fsdp_all_gather_largest_unit", "fsdp_backward", "loss_logits_softmax",
                  "ep_buffers", "backward_working_set"}


def _check_schema(result: dict, world_size: int, n_ranks: int) -> None:
    assert result["world_size"] == world_size
    assert len(result["ranks"]) == n_ranks
    for r in result["ranks"]:
        assert set(r) == RANK_KEYS
        assert set(r["transients"]) == TRANSIENT_KEYS
        assert r["optimizer_state_bytes"] == 2 * r["parameter_bytes"] == 2 * r["gradient_bytes"]
        assert r["predicted_peak_bytes"] > r["parameter_bytes"] + r["optimizer_state_bytes"]
        assert r["predicted_peak_bytes"] >= (r["parameter_bytes"] + r["optimizer_state_bytes"]
                                             + max(r["forward_backward_peak_bytes"], r["optimizer_phase_bytes"]))
        assert all(v >= 0 for v in r["transients"].values())


def test_cli_json_one_rank():
    r = subprocess.run([sys.executable, "-m", "trainer.memory_plan", "--config",
                        os.path.join(CONFIGS, "debug_model.toml"), "--ngpu", "1", "--json",
                        "--training.seq_len", "128"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    _check_schema(result, 1, 1)
    assert result["ranks"][0]["layers"] == list(range(6))


@pytest.mark.parametrize("toml, world, n_stages", [("deepseek_v3_16b.toml", 16, 2), ("deepseek_v3_671b.toml", 512, 8)])
def test_large_layouts_match_dry_run(toml, world, n_stages):
    from parallelisms.dry_run import report

    cfg = load_config(["--job.config_file", os.path.join(CONFIGS, toml)])
    result = plan(cfg, world, device="cuda")
    _check_schema(result, world, n_stages)
    dry = report(cfg, world)
    assert [r["parameter_bytes"] for r in result["ranks"]] == [d["param_bytes"] for d in dry]
    assert [r["params"] for r in result["ranks"]] == [d["params"] for d in dry]
    # every layer lives on exactly one stage
    from trainer.registry import get_model_spec

    n_layers = get_model_spec(cfg.model.name).build_args(cfg).n_layers
    assert sorted(i for r in result["ranks"] for i in r["layers"]) == list(range(n_layers))


def test_debug_row_within_15_percent_of_measured(tmp_path):
    """AC none, 1 rank, batch 4 x 128: the plan against MemoryMonitor's exact peak of a real run."""
    import torch

    from trainer.train import Trainer, prepare

    args = ["--job.config_file", os.path.join(CONFIGS, "debug_model.toml"), "--memory.track", "exact",
            "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
            "--training.local_batch_size", "4", "--training.seq_len", "128", "--training.steps", "2",
            "--job.dump_folder", str(tmp_path)]
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


def test_smoke_check_json_schema():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "memory_plan_check.py"), "--smoke"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    assert {"ngpu", "ac", "batch", "seq_len", "steps", "predicted_peak_MiB", "measured_peak_MiB", "ratio",
            "within_15pct", "predicted_phase", "per_rank_measured_MiB"} <= set(row)
    assert row["ngpu"] == 1 and row["ac"] == "none" and row["steps"] == 2
    assert row["within_15pct"]
