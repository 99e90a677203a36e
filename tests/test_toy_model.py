"""Adding a model family (docs/architecture.md, "Adding a model"): `tests/toy_model.py` registers a second family,
and the unchanged trainer trains it, checks its recompute names and applies activation checkpointing to it."""

from __future__ import annotations

import logging
import math

import pytest

from core.config import ConfigError
from trainer.job_config import load_config, model_job, validate_job
from trainer.train import run

import toy_model

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.name", "toy_dense", "--model.flavor", "tiny",
        "--training.steps", "3", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "-1", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
        "--memory.track", "off", "--training.deterministic", "true"]


@pytest.fixture(autouse=True)
def _registered():
    toy_model.register()


def test_the_trainer_trains_a_registered_family(tmp_path):
    losses = {}
    for name, extra in {"no_ac": [], "full_ac": ["--activation_checkpoint.mode", "full"],
                        "recompute_mlp": ["--activation_checkpoint.mode", "selective",
                                          "--activation_checkpoint.recompute_modules", "mlp,layernorm"]}.items():
        history: list[dict] = []
        run(load_config(BASE + ["--job.dump_folder", str(tmp_path / name)] + extra), history=history)
        losses[name] = [h["loss"] for h in history]
    steps = losses["no_ac"]
    assert len(steps) == 3 and all(math.isfinite(x) for x in steps), steps
    # untrained: about ln(vocab) (the head starts near zero); then the optimizer lowers it
    assert abs(steps[0] - math.log(toy_model.ToyArgs().vocab_size)) < 0.1 and steps[-1] < steps[0], steps
    # recomputing in backward changes no number
    assert losses["full_ac"] == steps and losses["recompute_mlp"] == steps, losses


def test_recompute_names_come_from_the_family():
    cfg = load_config(BASE + ["--activation_checkpoint.mode", "selective",
                              "--activation_checkpoint.recompute_modules", "moe_act"])
    with pytest.raises(ConfigError, match="recompute_modules: unknown module name .moe_act.; allowed: mlp, layernorm"):
        validate_job(cfg, 1)


def test_the_family_reports_its_own_config_errors():
    cfg = load_config(BASE + ["--model.flavor", "huge"])
    with pytest.raises(ConfigError, match="model.flavor: unknown flavor 'huge'; allowed: tiny"):
        toy_model.SPEC.build_args(model_job(cfg))
    cfg = load_config(BASE + ["--fp8.recipe", "blockwise", "--fp8.modules", "attention"])
    with pytest.raises(ConfigError, match="fp8.modules: 'attention' matches no linear .*names or dotted parts of: mlp.w1"):
        toy_model.SPEC.build_args(model_job(cfg))


@pytest.mark.slow
def test_the_family_trains_with_fp8_selective_ac_and_compile_under_its_own_names(tmp_path, caplog):
    """Nothing outside tests/toy_model.py names the toy's modules: its "default" module names select its MLPs for
    FP8 and its norms for recompute, and compile takes its blocks. Blockwise FP8 with selective AC, compiled, trains
    like the same run in eager (FP8's numbers do not depend on compile beyond rounding)."""
    caplog.set_level(logging.INFO)
    fp8 = ["--fp8.recipe", "blockwise", "--activation_checkpoint.mode", "selective"]
    histories = {}
    for name, extra in {"eager": [], "compiled": ["--compile.enable", "true"]}.items():
        history: list[dict] = []
        run(load_config(BASE + fp8 + extra + ["--job.dump_folder", str(tmp_path / name)]), history=history)
        histories[name] = [h["loss"] for h in history]
    messages = [r.getMessage() for r in caplog.records]
    converted = [m for m in messages if m.startswith("fp8 blockwise: ")]
    assert converted and all(m.startswith("fp8 blockwise: 6 modules converted (layers.0.mlp.w1") for m in converted)
    assert not [m for m in messages if "matches no module" in m]
    assert any(m.startswith("compiling 2 blocks and the loss") for m in messages)
    assert histories["compiled"] == pytest.approx(histories["eager"], rel=1e-4), histories
    assert histories["eager"][-1] < histories["eager"][0]
