"""Checkpointing: exact resume, reshard across layouts, atomic saves, restart after a killed rank, NaN policy."""

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from dist_utils import run_cli
from small_models import SMALL, TINY, hf_config_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainer.checkpoint.files import list_checkpoints
from trainer.job_config import load_config
from trainer.train import TrainingError, Trainer, prepare, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The debug model's checkpoint is 378 MiB with the Adam state; these tests save up to 10 of them. SMALL's is 22 MiB.
BASE = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", hf_config_file(SMALL),
        "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.local_batch_size", "4", "--validation.enable", "false",
        "--memory.track", "off", "--metrics.enable_tensorboard", "false", "--training.deterministic", "true",
        "--checkpoint.enable", "true", "--checkpoint.interval", "5"]


def _cfg(dump, *args):
    return load_config(BASE + ["--job.dump_folder", str(dump), *args])


def _model_tensors(ckpt_dir, tmp_path):
    out = tmp_path / f"{os.path.basename(ckpt_dir)}_{len(os.listdir(tmp_path))}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return torch.load(out, weights_only=False)["model"]


@pytest.mark.slow
def test_resume_is_exact_and_data_neither_repeats_nor_skips(tmp_path, monkeypatch):
    """Also the validation losses (every 4 steps): every validation reads the same batches, resumed or not."""
    validation = ["--training.steps", "10", "--validation.enable", "true", "--validation.freq", "4"]
    straight_history: list[dict] = []
    straight = run(_cfg(tmp_path / "straight", *validation), history=straight_history)
    original = Trainer.train_step

    def interrupted(self, step):
        if step == 7:
            raise KeyboardInterrupt  # Ctrl-C in step 7: the last checkpoint is step 5
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tmp_path / "split", *validation))
    monkeypatch.setattr(Trainer, "train_step", original)
    assert list_checkpoints(tmp_path / "split" / "checkpoint") == [5]
    resumed_history: list[dict] = []
    resumed = run(_cfg(tmp_path / "split", *validation), history=resumed_history)
    assert resumed == straight[5:]  # bit-identical, deterministic mode
    validated = {step: h["validation/loss"] for step, h in enumerate(resumed_history, 6) if "validation/loss" in h}
    straight_validated = {step: h["validation/loss"] for step, h in enumerate(straight_history, 1)
                          if "validation/loss" in h}
    assert list(straight_validated) == [4, 8] and validated == {8: straight_validated[8]}
    a = _model_tensors(tmp_path / "straight" / "checkpoint" / "step-10", tmp_path)
    b = _model_tensors(tmp_path / "split" / "checkpoint" / "step-10", tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("moe.expert_bias") for k in a)


@pytest.mark.slow
def test_resume_with_more_steps_follows_the_new_lr_schedule(tmp_path, monkeypatch, caplog):
    """5 steps, then the same run resumed to 10, against 10 straight: from step 6 on, the same LR (the one the
    optimizer steps with and the one logged) and, deterministic, the same losses. The losses match because the
    debug config's 5 warmup steps give steps 1-5 the same LR under both schedules; a schedule that decays
    within the first run gives it other weights at step 5, and then only the LRs match."""
    used = {}  # dump folder -> [(step, LR in the optimizer's param group, logged LR)]
    original = Trainer.train_step

    def recording(self, step):
        lr = self.optimizers[0].param_groups[0]["lr"]
        scalars = original(self, step)
        used.setdefault(self.cfg.job.dump_folder, []).append((step, lr, scalars["lr"]))
        return scalars

    monkeypatch.setattr(Trainer, "train_step", recording)
    straight = run(_cfg(tmp_path / "straight", "--training.steps", "10"))
    run(_cfg(tmp_path / "extended", "--training.steps", "5"))
    caplog.set_level("INFO", logger="trainer")
    resumed = run(_cfg(tmp_path / "extended", "--training.steps", "10"))
    want, got = used[str(tmp_path / "straight")][5:], used[str(tmp_path / "extended")][5:]
    assert [s for s, _, _ in got] == list(range(6, 11))
    assert got == want  # bit-equal LRs, used and logged
    assert resumed == straight[5:]
    changed = [r.getMessage() for r in caplog.records if "LR schedule changed" in r.getMessage()]
    assert len(changed) == 1 and "training.steps 5 -> 10" in changed[0] and "from step 6 on" in changed[0], changed


def test_lr_schedule_state_is_its_position_and_names_what_changed():
    from trainer.lr_schedule import LRSchedulerSection
    from trainer.lr_schedule import build_lr_scheduler, lr_factor

    def scheduler(total, lr=1.0, **cfg):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return opt, build_lr_scheduler(opt, LRSchedulerSection(**cfg), total)

    opt, old = scheduler(5)
    for _ in range(3):
        opt.step()
        old.step()
    state = old.state_dict()
    opt, new = scheduler(10, lr=0.5, warmup_steps=1)
    new.load_state_dict(state)
    expected = 0.5 * lr_factor(4, 10, 1, "linear", 1.0, 0.0)
    assert new.get_last_lr() == [expected] and opt.param_groups[0]["lr"] == expected
    assert new.resume_changes == [("training.steps", 5, 10), ("optimizer.lr", 1.0, 0.5),
                                  ("lr_scheduler.warmup_steps", 2, 1)]
    # a plain LambdaLR's state (no settings recorded) restores the position alone
    opt, plain = scheduler(10)
    lambda_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(lambda_opt, lambda epoch: 1.0)
    for _ in range(3):
        lambda_opt.step()
        lambda_lr.step()
    plain.load_state_dict(lambda_lr.state_dict())
    assert plain.last_epoch == 3 and plain.get_last_lr() == [lr_factor(4, 10, 2, "linear", 1.0, 0.0)]
    assert plain.resume_changes == []


@pytest.mark.slow
def test_interrupted_save_is_never_picked_and_keep_latest_k(tmp_path, caplog):
    run(_cfg(tmp_path, "--training.steps", "10", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"))
    folder = tmp_path / "checkpoint"
    assert list_checkpoints(folder) == [8, 10]
    # a save killed half-way leaves only a .tmp folder (and a folder without metadata is not complete)
    shutil.copytree(folder / "step-10", folder / "step-12.tmp")
    os.makedirs(folder / "step-14")
    assert list_checkpoints(folder) == [8, 10]
    args = ["--training.steps", "11", "--checkpoint.interval", "2"]
    # run_train.sh runs preflight, then the trainer: the skipped folders are named once, by the trainer
    preflight = run_cli("trainer.preflight", [*BASE, "--job.dump_folder", str(tmp_path), *args])
    assert preflight.returncode == 0 and preflight.stderr == "", preflight.stderr
    caplog.set_level(logging.INFO)
    resumed = run(_cfg(tmp_path, *args))
    assert len(resumed) == 1  # continued after step 10
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [f"checkpoint: skipped step-12.tmp (an unfinished save), step-14 (no .metadata) in {folder}; "
                       "resuming from step-10"]


@pytest.mark.slow
def test_model_only_last_save_in_bf16(tmp_path):
    """The model-only export holds the model alone, every tensor the full checkpoint's fp32 one cast to bf16 (the
    runs are deterministic, so both trained the same weights)."""
    for name, only in (("export", "true"), ("full", "false")):
        run(_cfg(tmp_path / name, "--training.steps", "2", "--checkpoint.last_save_model_only", only,
                 "--checkpoint.export_dtype", "bfloat16"))
    export, full = (tmp_path / name / "out.pt" for name in ("export", "full"))
    dcp_to_torch_save(str(tmp_path / "export" / "checkpoint" / "step-2"), str(export))
    dcp_to_torch_save(str(tmp_path / "full" / "checkpoint" / "step-2"), str(full))
    export, full = torch.load(export, weights_only=False), torch.load(full, weights_only=False)
    assert list(export) == ["model"] and "optimizer" in full
    assert export["model"].keys() == full["model"].keys() and any(k.endswith("moe.expert_bias") for k in full["model"])
    for key, want in full["model"].items():
        assert want.dtype == torch.float32 and torch.equal(export["model"][key], want.to(torch.bfloat16)), key


@pytest.mark.slow
def test_initial_load_from_native_checkpoint(tmp_path):
    run(_cfg(tmp_path / "a", "--training.steps", "5"))
    seed = str(tmp_path / "a" / "checkpoint" / "step-5")
    straight = run(_cfg(tmp_path / "s", "--training.steps", "6", "--checkpoint.enable", "false"))
    # fresh run starting from step-5 weights (optimizer fresh): first loss equals the loss of step 6's weights
    loaded = run(_cfg(tmp_path / "b", "--training.steps", "1", "--checkpoint.enable", "false",
                      "--checkpoint.initial_load_path", seed))
    assert loaded[0] != straight[0] and loaded[0] < straight[0]


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_nonfinite_loss_policy(tmp_path, monkeypatch, policy):
    original = Trainer._forward_backward

    def poisoned(self, inputs, labels, global_tokens):
        loss = original(self, inputs, labels, global_tokens)
        return loss * float("nan") if self.checkpoint.train_state.step == 0 and _calls.append(1) is None \
            and len(_calls) == 2 else loss

    _calls = []
    monkeypatch.setattr(Trainer, "_forward_backward", poisoned)
    cfg = _cfg(tmp_path, "--training.steps", "3", "--checkpoint.enable", "false",
               "--training.on_nonfinite", policy)
    if policy == "stop":
        with pytest.raises(TrainingError, match="step 2: non-finite"):
            run(cfg)
    else:
        losses = run(cfg)
        assert len(losses) == 3 and losses[1] != losses[1] and losses[2] == losses[2]


RESHARD = ["--training.steps", "6", "--checkpoint.interval", "3", "--training.local_batch_size", "2",
           "--metrics.log_freq", "1"]  # every step logged: an interrupted job's history holds its steps


@pytest.mark.slow
def test_reshard_save_at_fsdp2_ep2_resume_at_fsdp4_one_rank_and_pp2(tmp_path, caplog):
    """Also the global batch of a resume with training.global_batch_size = -1 (the default): the checkpoint's
    (2 ranks x local_batch_size 2 = 4 sequences), kept at pp2 (data-parallel degree 1) and on one rank by gradient
    accumulation, with one line saying so; so their losses are the straight run's. A checkpoint's batch that is
    no multiple of the new layout's is refused before launch, naming the key."""
    from core.config import ConfigError
    from dist_utils import launch

    default_batch = ["--training.global_batch_size", "-1"]
    reference = run(_cfg(tmp_path / "reference", *RESHARD))
    saved = launch(2, {"save": {"args": RESHARD + ["--parallelism.expert_parallel_degree", "2", *default_batch],
                                "stop_after": 3}}, tmp_path, BASE)
    assert [h["loss"] for h in saved["save"]] == pytest.approx(reference[:3], rel=2e-5)
    src = tmp_path / "save" / "checkpoint" / "step-3"
    for name in ("fsdp4", "one_rank", "pp2"):
        shutil.copytree(src, tmp_path / name / "checkpoint" / "step-3")
    four = launch(4, {"fsdp4": RESHARD + ["--training.local_batch_size", "1"]}, tmp_path, BASE)["fsdp4"]
    pp2 = launch(2, {"pp2": RESHARD + ["--parallelism.pipeline_parallel_degree", "2",
                                       "--parallelism.pipeline_parallel_schedule", "GPipe", *default_batch]},
                 tmp_path, BASE)["pp2"]
    caplog.set_level("INFO", logger="trainer")
    one = run(_cfg(tmp_path / "one_rank", *RESHARD, *default_batch))
    for name, losses in (("fsdp4", [h["loss"] for h in four]), ("pp2", [h["loss"] for h in pp2]), ("one", one)):
        assert losses == pytest.approx(reference[3:], rel=2e-5), name
    assert [r.getMessage() for r in caplog.records if "global_batch_size" in r.getMessage()] == [
        "training.global_batch_size = -1: keeping the checkpoint's global batch of 4 sequences per step "
        "(local_batch_size 2 x data-parallel degree 1 x 2 gradient accumulation steps); set "
        "training.global_batch_size to change it"]
    with pytest.raises(ConfigError, match=r"^config error: training.global_batch_size: -1 keeps the global batch of "
                                          r"the checkpoint \S+step-6, 4 sequences, which is not a multiple of "
                                          r"local_batch_size 3 x data-parallel degree 1 = 3"):
        prepare(_cfg(tmp_path / "one_rank", *RESHARD, *default_batch, "--training.local_batch_size", "3",
                     "--training.steps", "7"), 1, 0)


@pytest.mark.slow
def test_killed_rank_restarts_and_reaches_the_same_final_loss(tmp_path):
    from trainer.metrics import read_scalars, run_dirs

    from dist_utils import launch

    args = ["--training.steps", "8", "--checkpoint.interval", "2", "--training.local_batch_size", "2",
            "--metrics.enable_tensorboard", "true"]
    # the reference is the same 2-rank layout uninterrupted: identical numerics, so the losses must match exactly
    reference = [h["loss"] for h in launch(2, {"reference": args}, tmp_path, BASE)["reference"]]
    dump = tmp_path / "faulty"
    env = dict(os.environ, NGPU="2", MAX_RESTARTS="1", CONFIG_FILE="train_configs/debug_model.toml")
    proc = subprocess.Popen(["./run_train.sh", *BASE[2:], "--job.dump_folder", str(dump), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not list_checkpoints(dump / "checkpoint") or list_checkpoints(dump / "checkpoint")[-1] < 4:
            assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert workers, "no worker processes found"
        os.kill(int(workers[-1]), signal.SIGKILL)  # a rank dies in the middle of step 5 or 6
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    # every (re)start is its own tensorboard run: the restarted one logs the steps after its checkpoint, up to 8
    losses = dict(read_scalars(run_dirs(str(dump / "tb"))[-1])["loss"])
    assert losses[8] == pytest.approx(reference[-1], rel=1e-6)


# ----------------------------------------------------------------------------------------------- weights that differ

def _small_config(tmp_path, **changes) -> str:
    """An HF config.json of TINY (with `changes`): a model that builds, trains a step and saves in about a second."""
    return hf_config_file(TINY.replace(**changes), tmp_path)


def _small_argv(config: str, dump, *args) -> list[str]:
    return ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path", config,
            "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "1",
            "--training.steps", "1", "--validation.enable", "false", "--memory.track", "off",
            "--metrics.enable_tensorboard", "false", *args]


def _trainer(argv: list[str]) -> tuple[Trainer, str | None]:
    """A one-process trainer, its checkpoint already loaded (as `run` builds it, without a process group), and the
    note of its partial load."""
    prep = prepare(load_config(argv), world_size=1, rank=0)
    return Trainer(prep, torch.device("cpu")), prep.checkpoint_note


def _train(trainer: Trainer) -> list[float]:
    try:
        return trainer.train()
    finally:
        trainer.close()


def _refused_in_preflight(argv: list[str], capsys) -> str:
    """The one line `python -m trainer.preflight` ends with (exit code 2, no traceback)."""
    from core.config import run_with_config_errors
    from trainer.tools.preflight import main as _check

    with pytest.raises(SystemExit) as exc:
        run_with_config_errors(_check, argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _model_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}


@pytest.mark.slow
def test_native_checkpoint_and_model_differing_in_mtp_are_refused_unless_a_partial_load(tmp_path, capsys):
    """Our own step-N checkpoints, saved with and without MTP, loaded by a run that builds the other: refused in
    preflight (initial load and resume) with one line naming the MTP weights, and the switch when the checkpoint
    lacks them; with checkpoint.allow_partial_load the run loads everything else and trains."""
    config = _small_config(tmp_path)
    no_mtp = _small_argv(config, tmp_path / "no_mtp", "--checkpoint.enable", "true", "--model.mtp_layers", "0")
    _train(_trainer(no_mtp)[0])
    step1 = str(tmp_path / "no_mtp" / "checkpoint" / "step-1")
    # a run with MTP on from a checkpoint without MTP weights: the switch that turns MTP off is named
    want = (f"config error: checkpoint: checkpoint {step1} lacks mtp.layers.0.* (19 weights) that the model "
            "expects; train without them: --model.mtp_layers 0")
    line = _refused_in_preflight(_small_argv(config, tmp_path / "mtp", "--model.mtp_layers", "1",
                                             "--checkpoint.initial_load_path", step1), capsys)
    assert line == want
    assert not (tmp_path / "mtp").exists()
    resume = no_mtp[:-1] + ["1", "--training.steps", "2"]
    assert _refused_in_preflight(resume, capsys) == want
    assert list_checkpoints(tmp_path / "no_mtp" / "checkpoint") == [1]

    # allowed: the MTP layer keeps its initialisation, the rest is the checkpoint's; it trains and saves with MTP
    with_mtp = _small_argv(config, tmp_path / "mtp", "--model.mtp_layers", "1", "--checkpoint.initial_load_path",
                           step1, "--checkpoint.allow_partial_load", "true", "--checkpoint.enable", "true")
    trainer, note = _trainer(with_mtp)
    assert note == f"partial load of {step1}: mtp.layers.0.* (19 weights) the checkpoint lacks keep their " \
                   "initialisation"
    saved, loaded = _model_tensors(step1, tmp_path), _model_weights(trainer)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved) and len(loaded) == len(saved) + 19
    assert all(math.isfinite(loss) for loss in _train(trainer))

    # the reverse, an MTP the run turns off: the checkpoint's mtp.* weights are named, on resume too
    mtp1 = str(tmp_path / "mtp" / "checkpoint" / "step-1")
    off = _small_argv(config, tmp_path / "off", "--model.mtp_layers", "0", "--checkpoint.initial_load_path", mtp1)
    line = _refused_in_preflight(off, capsys)
    assert f"checkpoint {mtp1} holds mtp.layers.0.* (19 weights) that the model does not have" in line
    assert line.endswith("checkpoint.allow_partial_load = true loads the rest")
    resume_off = _small_argv(config, tmp_path / "mtp", "--model.mtp_layers", "0", "--checkpoint.enable", "true",
                             "--training.steps", "2")
    assert f"checkpoint {mtp1} holds mtp.layers.0.* (19 weights)" in _refused_in_preflight(resume_off, capsys)
    trainer, note = _trainer(off + ["--checkpoint.allow_partial_load", "true"])
    assert note == f"partial load of {mtp1}: skipped mtp.layers.0.* (19 weights) the model does not have"
    saved, loaded = _model_tensors(mtp1, tmp_path), _model_weights(trainer)
    assert loaded.keys() == {k for k in saved if not k.startswith("mtp.")}
    assert all(torch.equal(loaded[k], saved[k]) for k in loaded)
    assert all(math.isfinite(loss) for loss in _train(trainer))


@pytest.mark.slow
def test_another_flavors_experts_are_named_and_a_partial_load_skips_them(tmp_path, capsys):
    """A checkpoint of a model with 16 experts (same names, other shapes) into one with 8: refused in preflight naming
    the first weights and their count (resume: a resume needs every weight); with checkpoint.allow_partial_load the
    weights that match in name and shape are loaded, the others keep their initialisation, and the run trains."""
    sixteen = _small_argv(_small_config(tmp_path, n_routed_experts=16), tmp_path / "sixteen", "--checkpoint.enable",
                          "true")
    _train(_trainer(sixteen)[0])
    step1 = str(tmp_path / "sixteen" / "checkpoint" / "step-1")
    config = _small_config(tmp_path)
    initial = _small_argv(config, tmp_path / "eight", "--checkpoint.initial_load_path", step1)
    line = _refused_in_preflight(initial, capsys)
    reshaped = ("layers.1.moe.expert_bias, layers.1.moe.router.gate.weight, layers.1.moe.experts.w1 and 2 more "
                "(5 weights)")
    assert line == (f"config error: checkpoint: checkpoint {step1} holds {reshaped} in other shapes than the model's "
                    "(layers.1.moe.expert_bias: [16] saved, [8] in the model): saved from another "
                    "flavor or other model settings?; checkpoint.allow_partial_load = true loads the weights that "
                    "match and skips these")
    resume = _small_argv(config, tmp_path / "sixteen", "--checkpoint.enable", "true", "--training.steps", "2",
                         "--checkpoint.allow_partial_load", "true")
    assert "a resume needs every weight" in _refused_in_preflight(resume, capsys)

    trainer, note = _trainer(initial + ["--checkpoint.allow_partial_load", "true"])
    assert note == (f"partial load of {step1}: skipped {reshaped} in other shapes than the model's (they keep their "
                    "initialisation)")
    fresh = _model_weights(_trainer(_small_argv(config, tmp_path / "fresh"))[0])
    saved, loaded = _model_tensors(step1, tmp_path), _model_weights(trainer)
    skipped = {k for k in loaded if saved[k].shape != loaded[k].shape}
    assert skipped == {"layers.1.moe.router.gate.weight", "layers.1.moe.expert_bias"} | {
        f"layers.1.moe.experts.w{i}" for i in (1, 2, 3)}
    assert all(torch.equal(loaded[k], fresh[k] if k in skipped else saved[k]) for k in loaded)
    assert not torch.equal(loaded["layers.0.attention.wo.weight"], fresh["layers.0.attention.wo.weight"])
    assert all(math.isfinite(loss) for loss in _train(trainer))


# ----------------------------------------------------------------------------------------------- full disk

@pytest.mark.slow
def test_a_full_disk_is_named_with_the_folder_and_the_bytes_free_and_needed(tmp_path, monkeypatch, caplog):
    """torch's writer reports a full disk as `unexpected pos 704 vs 598`, without an errno: the save's one line
    says the disk is full, naming the folder and the bytes free and needed. A disk too small from the start: a
    warning at start, and the first save fails before writing anything."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import trainer.checkpoint.manager as manager
    from trainer.checkpoint.manager import CheckpointSaveError

    write_data, free = dcp_fs.FileSystemWriter.write_data, {"bytes": 2 ** 40}

    def full_at_step_2(self, plan, planner):
        if "step-2.tmp" in str(self.path):
            free["bytes"] = 4096
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp_fs.FileSystemWriter, "write_data", full_at_step_2)
    monkeypatch.setattr(manager, "free_bytes", lambda folder: free["bytes"])
    folder = tmp_path / "full" / "checkpoint"
    with pytest.raises(CheckpointSaveError) as err:
        run(_cfg(tmp_path / "full", "--training.steps", "3", "--checkpoint.interval", "1"))
    match = re.fullmatch(
        rf"saving {folder}/step-2.tmp failed: the disk is full: {folder} has 4.0 KiB free, a checkpoint needs about "
        r"([\d.]+) MiB \(rank 0: RuntimeError: \[enforce fail at inline_container.cc:672\] . unexpected pos 704 vs "
        r"598\); the previous checkpoint stays the latest \(step-1\)", str(err.value))
    assert match, str(err.value)
    size = sum(f.stat().st_size for f in (folder / "step-1").iterdir())
    assert abs(float(match.group(1)) * 2 ** 20 - size) < 0.05 * size  # the estimate is the checkpoint's size
    assert sorted(os.listdir(folder)) == ["step-1"]

    free["bytes"] = 2 ** 20
    monkeypatch.setattr(dcp_fs.FileSystemWriter, "write_data", lambda *args: pytest.fail("wrote to a full disk"))
    caplog.set_level("WARNING", logger="trainer")
    small = tmp_path / "small" / "checkpoint"
    with pytest.raises(CheckpointSaveError, match=rf"^saving {small}/step-1.tmp failed: the disk is full: {small} has "
                                                  r"1.0 MiB free, a checkpoint needs about [\d.]+ MiB; the previous "
                                                  r"checkpoint stays the latest \(none yet\)$"):
        run(_cfg(tmp_path / "small", "--training.steps", "1"))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"checkpoint: {small} has 1.0 MiB free; a checkpoint needs more than the model's weights alone, 7.3 MiB: the "
        "saves will fail (free space, or set job.dump_folder or checkpoint.folder to a larger disk)"]
    assert os.listdir(small) == []


# ----------------------------------------------------------------------------------------------- damaged files

def _zero_inside(file) -> None:
    """Zero the middle half of `file`, keeping its size (a bad sector, a stale page of a network file system)."""
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.seek(size // 4)
        f.write(b"\0" * (size // 2))


@pytest.mark.slow
def test_a_checkpoint_corrupt_at_its_size_falls_back_on_every_rank_with_one_warning(tmp_path):
    """2 ranks, one launch (the worker is this file, `_corrupt_worker`): a run saves steps 1-3 with
    checkpoint.verify = "checksum"; rank 1's file of step-3 is zeroed inside, its size kept. The next run's ranks
    find it by its checksum, all fall back to step-2 and continue with the straight run's losses. Then rank 1's file
    of step-4 and rank 0's of step-3 are zeroed, and a run with verify = "size" (stat only) fails to load each in
    turn: every rank falls back to step-2, loaded whole (the losses are again the straight ones, bit for bit), and
    rank 0 warns once, naming each file and why."""
    from dist_utils import launch_json

    args = BASE + ["--training.local_batch_size", "2", "--checkpoint.interval", "1", "--job.dump_folder",
                   str(tmp_path / "run")]
    result = launch_json(2, os.path.abspath(__file__), {"corrupt": args}, tmp_path)["corrupt"]
    folder = tmp_path / "run" / "checkpoint"
    straight, by_checksum, by_load = result["losses"]
    assert len(straight) == 3 and by_checksum[0] == straight[2] and by_load[:2] == [straight[2], by_checksum[1]]
    assert result["steps"] == [[[1, 2, 3]] * 2, [[3, 4]] * 2, [[3, 4, 5]] * 2]  # every rank resumed from step-2
    assert result["warnings"][1] == [[], [], []]
    assert result["warnings"][0][1] == [
        "checkpoint: skipped step-3 (rank 1: __1_0.distcp does not match its checksum (changed since it was saved)) "
        f"in {folder}; resuming from step-2"]
    (line,) = result["warnings"][0][2]
    assert line.startswith("checkpoint: skipped step-3 (cannot be loaded: rank 0: __0_0.distcp: "), line
    assert re.search(r"\), step-4 \(cannot be loaded: rank [01]: __1_0\.distcp: \w+: ", line), line
    assert line.endswith(f") in {folder}; resuming from step-2"), line
    assert sorted(os.listdir(folder / "step-2" / "checksums")) == ["rank_0.json", "rank_1.json"]


def _corrupt_worker(jobs_path: str, out_path: str) -> None:
    """Rank entry point of the corrupt-checkpoint test: three runs of one job, files zeroed between them."""
    import torch.distributed as dist
    from dist_worker import worker_session

    class Warnings(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    with worker_session(jobs_path, out_path, timeout_s=300) as (jobs, results):
        args = jobs["corrupt"]
        folder = os.path.join(args[args.index("--job.dump_folder") + 1], "checkpoint")
        runs = [(3, "checksum", []), (4, "checksum", ["step-3/__1_0.distcp"]),
                (5, "size", ["step-4/__1_0.distcp", "step-3/__0_0.distcp"])]
        losses, steps, warnings = [], [], []
        for total, verify, zeroed in runs:
            if dist.get_rank() == 0:
                for name in zeroed:
                    _zero_inside(os.path.join(folder, name))
            dist.barrier()
            handler = Warnings()
            logging.getLogger("trainer").addHandler(handler)
            history: list[dict] = []
            try:
                losses.append(run(load_config(args + ["--training.steps", str(total), "--checkpoint.verify", verify]),
                                  shutdown=False, history=history))
            finally:
                logging.getLogger("trainer").removeHandler(handler)
            steps.append(list(range(total - len(history) + 1, total + 1)))  # the steps this rank trained
            warnings.append(handler.lines)
        gathered = [None, None]
        dist.all_gather_object(gathered, (steps, warnings))
        results["corrupt"] = {"losses": losses, "steps": [[ranks[i] for ranks, _ in gathered] for i in range(3)],
                              "warnings": [lines for _, lines in gathered]}


if __name__ == "__main__":
    _corrupt_worker(sys.argv[1], sys.argv[2])
