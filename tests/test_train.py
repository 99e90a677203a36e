"""End-to-end tests of the single-process train loop and of the command-line entry points."""

import dataclasses
import logging
import os
import re
import subprocess
import time

import pytest
import torch
from dist_utils import run_cli

from trainer.tools import preflight
from core.config import ConfigError, config_to_toml, run_with_config_errors
from trainer.job_config import load_config
from trainer.memory.ranks import read_worst_ranks
from trainer.metrics import read_hparams, read_scalars, run_dirs
from core.model_spec import TrainingHooks, register_model_spec
from trainer.registry import get_model_spec
from trainer.summary import RunSummary
from trainer.train import Trainer, prepare, run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(tmp_path, *overrides):
    return load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                        "--training.seq_len", "64", "--training.steps", "8", "--lr_scheduler.warmup_steps", "2",
                        "--validation.freq", "4", "--metrics.log_freq", "4", *overrides])


def _images(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"images": 0})
    events.Reload()
    return events.Images(tag)


def _messages(caplog, pattern):
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


@pytest.mark.slow
def test_debug_model_trains_with_falling_loss_and_tensorboard(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    losses = run(_cfg(tmp_path))
    assert len(losses) == 8
    # 8.13 -> 7.03 on torch 2.13, 8.05 -> 7.06 on 2.11: trunc_normal_ samples differently since 2.13, so one seed
    # gives other initial weights on each
    assert losses[-1] < losses[0] - 0.75, losses
    [run_dir] = run_dirs(os.path.join(tmp_path, "tb"))
    scalars = read_scalars(run_dir)
    for tag in ("loss", "grad_norm", "lr", "memory/allocated_GiB/max",
                "memory/peak_allocated_GiB/max", "memory/rss_GiB/median",
                "moe/layer_1/max_over_mean", "moe/layer_5/bias_range"):
        assert [s for s, _ in scalars[tag]] == list(range(1, 9)), tag
    # throughput over the steps since the last logging step (no wait for the device in between): at logging steps;
    # one process: the job's is rank 0's
    assert [s for s, _ in scalars["throughput/job_tokens_per_s"]] == [1, 4, 8]
    assert scalars["throughput/job_tokens_per_s"] == scalars["throughput/rank0_tokens_per_s"]
    assert [s for s, _ in scalars["throughput/rank0_data_loading_pct"]] == [1, 4, 8]
    assert all(0 < pct < 100 for _, pct in scalars["throughput/rank0_data_loading_pct"])
    assert [s for s, _ in scalars["validation/loss"]] == [4, 8]
    # memory at step end is flat after warm-up (exact CPU tracker), and the peak exceeds it; one process: the
    # spread over the ranks is its own value, rank 0's
    alloc = [v for _, v in scalars["memory/allocated_GiB/max"]]
    assert max(alloc[2:]) - min(alloc[2:]) < 1e-6
    assert all(p > a for (_, p), a in zip(scalars["memory/peak_allocated_GiB/max"], alloc))
    assert scalars["memory/peak_allocated_GiB/min"] == scalars["memory/peak_allocated_GiB/max"]
    assert read_worst_ranks(run_dir)["memory/peak_allocated_GiB"] == [(1, 0), (4, 0), (8, 0)]  # logging steps
    # the experts' load: one image per logging step
    assert [(e.step, e.height > 5 * 4) for e in _images(run_dir, "moe/tokens_per_expert")] == [(1, True), (4, True),
                                                                                               (8, True)]
    # the run's HParams row: what shapes memory, with the run's peak, speed and loss at its last step
    hparams = read_hparams(run_dir)
    assert hparams["world_size"] == 1 and hparams["ac_mode"] == "none" and hparams["dtype"] == "float32"
    assert scalars["run/final_loss"] == [(8, pytest.approx(losses[-1]))]
    assert scalars["run/peak_memory_GiB"][0][1] == pytest.approx(max(v for _, v in
                                                                     scalars["memory/peak_allocated_GiB/max"]))
    assert scalars["run/job_tokens_per_s"][0][1] > 0
    assert "run/compile_s" not in scalars  # nothing compiled: not measured, so not written
    # the expert bias moved (aux-loss-free balancing ran once per step)
    assert scalars["moe/layer_1/bias_range"][-1][1] > 0
    # console: step 1 although log_freq is 4, then every 4th step; one summary line of the whole run
    assert [int(m.split()[1]) for m in _messages(caplog, r"^step +\d+  loss")] == [1, 4, 8]
    peak = max(v for _, v in scalars["memory/peak_allocated_GiB/max"])
    val_loss = scalars["validation/loss"][-1][1]
    [summary] = _messages(caplog, "^run done")
    assert re.fullmatch(rf"run done: steps 1-8 in (\d+\.\d s|\d+m\d\ds), 2,048 tokens, final loss {losses[-1]:.4f}, "
                        rf"validation loss {val_loss:.4f} \(step 8\), peak tensor memory {peak:.2f} GiB, "
                        rf"tensorboard {re.escape(run_dir)}, no checkpoint", summary), summary


def test_run_summary_says_how_long_compiling_took():
    """A compiled run's summary line says how much of its steps' time went to torch.compile, and its HParams row
    gets `run/compile_s`; an uncompiled run's has neither."""
    summary = RunSummary(start=time.perf_counter())
    summary.add_step(1, 2.5, 512, 60.0)
    summary.add_step(2, 2.25, 512, 0.5)
    assert "compiling" not in summary.line(0, 2, None, None) and "run/compile_s" not in summary.run_metrics()
    summary.compile_s = 47.8
    assert re.match(r"steps 1-2 in \d+\.\d s \(47\.8 s of it compiling\), 1,024 tokens, final loss 2\.2500, ",
                    summary.line(0, 2, None, None))
    assert summary.run_metrics()["run/compile_s"] == 47.8


@pytest.mark.slow
def test_each_run_writes_its_own_tensorboard_run_and_logs_only_measured_memory(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    untracked = ("--training.steps", "2", "--validation.enable", "false", "--memory.track", "off")
    first = run(_cfg(tmp_path, *untracked, "--training.steps", "3"))
    second = run(_cfg(tmp_path, *untracked))
    tb = os.path.join(tmp_path, "tb")
    runs = run_dirs(tb)
    assert len(runs) == 2
    # each run folder holds one run's steps, never the other's
    assert [[(s, pytest.approx(v)) for s, v in read_scalars(r)["loss"]] for r in runs] == [
        list(zip([1, 2, 3], first)), list(zip([1, 2], second))]
    parent = os.path.dirname(os.path.abspath(tmp_path))
    assert _messages(caplog, "^tensorboard:") == [
        f"tensorboard: this run writes to {r}; compare it with the other runs of this job: tensorboard --logdir {tb} "
        f"(with every job under {parent}: --logdir {parent})" for r in runs]
    # the run folders say what the command line set, and always the AC mode, the layout and the dtype
    labels = [os.path.basename(r).rsplit("-", 2)[0].split(",") for r in runs]
    assert "steps=3" in labels[0] and "steps=2" in labels[1] and all("track=off" in label for label in labels)
    assert all(label[label.index("ac=none"):][:3] == ["ac=none", "1rank", "fp32"] for label in labels), labels
    # tracking off: no tensor memory tag and no leak slope (no zeros that look measured); the process RSS is logged
    scalars = read_scalars(runs[1])
    assert not [tag for tag in scalars if tag.startswith("memory/") and not tag.startswith("memory/rss_GiB/")], \
        list(scalars)
    rss = [v for _, v in scalars["memory/rss_GiB/max"]]
    assert len(rss) == 2 and all(0.1 < v < 64 for v in rss), rss
    assert len(_messages(caplog, r"tensor memory is not tracked \(memory.track = off\)")) == 2  # once per run
    console = _messages(caplog, r"^step +\d+  loss")[-2:]
    assert [line.split()[1] for line in console] == ["1", "2"] and all(" rss " in line for line in console)
    assert "mem " not in " ".join(console)
    summary = _messages(caplog, "^run done")[-1]
    assert "steps 1-2 in " in summary and ", 512 tokens, " in summary
    assert re.search(rf"max RSS {max(rss):.2f} GiB \(tensor memory not tracked\), tensorboard {re.escape(runs[1])}",
                     summary), summary


def test_compile_is_announced_with_an_estimate_before_the_first_step(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    prep = prepare(_cfg(tmp_path, "--compile.enable", "true", "--metrics.enable_tensorboard", "false"), 1, 0)
    trainer = Trainer(prep, torch.device("cpu"))  # compiling is lazy: nothing compiles before the first step
    trainer.close()
    # the debug model: one dense and five MoE blocks share two block graphs; the loss is the third
    assert _messages(caplog, "^compiling") == [
        "compiling 6 blocks and the loss (3 graphs): the first step takes ~45 s longer (~15 s per graph, the cold "
        "compile time measured on a 2-core CPU, docs/compile.md; less with a warm inductor cache)"]
    [memory] = _messages(caplog, "^memory:")
    assert "not tracked (compile.enable = true" in memory


@pytest.mark.slow
def test_deterministic_runs_are_bit_identical(tmp_path):
    args = ("--training.deterministic", "true", "--training.steps", "3", "--validation.enable", "false",
            "--memory.track", "off", "--metrics.enable_tensorboard", "false")
    first = run(_cfg(tmp_path / "a", *args))
    assert len(first) == 3 and first == run(_cfg(tmp_path / "b", *args))
    assert torch.are_deterministic_algorithms_enabled()
    # a process-wide switch: a later job of the same process that does not ask for it runs without it (on CUDA,
    # deterministic mode refuses some ops outright)
    run(_cfg(tmp_path / "c", "--training.steps", "1", "--validation.enable", "false", "--memory.track", "off",
             "--metrics.enable_tensorboard", "false"))
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    common = ("--training.steps", "3", "--validation.enable", "false", "--memory.track", "off",
              "--metrics.enable_tensorboard", "false", "--training.global_batch_size", "4")
    whole = run(_cfg(tmp_path / "a", *common, "--training.local_batch_size", "4"))
    accumulated = run(_cfg(tmp_path / "b", *common, "--training.local_batch_size", "2"))
    assert accumulated == pytest.approx(whole, rel=1e-5)


def test_model_spec_hooks_run_at_build_and_around_every_step(tmp_path):
    """configure_model once on the built model, then per step before_step (global valid tokens) before the
    forward and post_optimizer_step after the update; DeepSeek-V3's hooks set the MoE aux-loss fields."""
    base = get_model_spec("deepseek_v3")
    events = []

    def configure(model, moe_cfg):
        events.append(("configure", len(model.moe_layers())))
        base.hooks.configure_model(model, moe_cfg)

    def before(model_parts, global_tokens):
        events.append(("before", global_tokens))
        base.hooks.before_step(model_parts, global_tokens)

    def post(model_parts, moe_cfg, dp_group):
        events.append(("post",))
        return base.hooks.post_optimizer_step(model_parts, moe_cfg, dp_group)

    hooks = TrainingHooks(configure_model=configure, before_step=before, post_optimizer_step=post)
    register_model_spec(dataclasses.replace(base, name="hooks_probe", hooks=hooks))
    cfg = _cfg(tmp_path, "--model.name", "hooks_probe", "--training.steps", "2", "--validation.enable", "false",
               "--metrics.enable_tensorboard", "false", "--memory.track", "off", "--moe.aux_loss_coeff", "0.01")
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    try:
        trainer.train()
    finally:
        trainer.close()
    tokens = cfg.training.local_batch_size * cfg.training.seq_len  # the debug data has no ignored labels
    assert events == [("configure", 5), ("before", tokens), ("post",), ("before", tokens), ("post",)]
    moe_layers = trainer.model_parts[0].moe_layers()
    assert all(m.aux_loss_coeff == 0.01 and m.aux_loss_grad_scale == 1 / tokens for m in moe_layers)


def test_data_loading_share_is_the_time_in_next_batch_over_the_logging_window(tmp_path):
    """throughput/rank0_data_loading_pct (run folder) and rank_data_loading_pct (rank folder): the share of the
    rank's wall time since the last logging step spent reading batches. A loader slowed by 0.15 s a batch: the
    share times the window (from the step's own rate) is the time measured inside it."""
    cfg = _cfg(tmp_path, "--training.steps", "3", "--validation.enable", "false", "--metrics.log_freq", "1",
               "--metrics.enable_tensorboard", "false", "--memory.track", "off")
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    inside, next_batch = [], trainer.train_loader.next_batch

    def slow_next_batch():
        start = time.perf_counter()
        time.sleep(0.15)
        batch = next_batch()
        inside.append(time.perf_counter() - start)
        return batch

    trainer.train_loader.next_batch = slow_next_batch
    history = []
    try:
        trainer.train(history)
    finally:
        trainer.close()
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    assert len(history) == len(inside) == 3
    for h, data_s in zip(history, inside):
        window_s = tokens / h["throughput/rank_tokens_per_s"]  # one step per window at log_freq 1
        measured_s = h["throughput/rank_data_loading_pct"] / 100 * window_s
        # the trainer's clock also holds the profiler label around the call (about 1 ms the first time)
        assert data_s <= measured_s < data_s + 0.005, (measured_s, data_s)
        assert h["throughput/rank0_data_loading_pct"] == h["throughput/rank_data_loading_pct"]


def test_pipeline_parallel_needs_the_models_split_units():
    register_model_spec(dataclasses.replace(get_model_spec("deepseek_v3"), name="no_split", pipeline=None))
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--model.name", "no_split",
                       "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
                       "--parallelism.pipeline_parallel_microbatch_size", "1"])
    with pytest.raises(ConfigError, match="parallelism.pipeline_parallel_degree: model 'no_split' has no pipeline"):
        prepare(cfg, 2, 0)


def _cli(args, env_extra=None, cmd=None):
    """`python -m trainer.train args` (forked: `dist_utils.run_cli`), or `cmd args` as a fresh process."""
    env = dict(os.environ, **(env_extra or {}))
    if cmd is None:
        return run_cli("trainer.train", args, env)
    return subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, key", [
    (["--training.stepz", "3"], "training.stepz"),
    (["--training.steps", "0"], "training.steps"),
    (["--model.flavor", "huge"], "model.flavor"),
    (["--training.seq_len", "16384"], "training.seq_len"),
    (["--tokenizer.path", "missing.tiktoken"], "tokenizer.path"),
    (["--dataset.path", "/nonexistent/data.jsonl"], "dataset"),
    (["--parallelism.expert_parallel_degree", "3"], "parallelism.expert_parallel_degree"),
])
@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, key):
    dump = tmp_path / "dump"
    r = _cli(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(dump), *args])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not dump.exists()


@pytest.mark.slow
def test_print_config_prints_merged_toml():
    """The entry point prints the merged config (the TOML that reads back to it, see tests/test_config.py) and
    nothing else: no training."""
    args = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "7"]
    r = _cli(args + ["--job.print_config", "true"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == config_to_toml(load_config(args))
    assert "steps = 7" in r.stdout.splitlines() and 'flavor = "debugmodel"' in r.stdout.splitlines()


def test_print_config_runs_the_checks_of_a_launch(tmp_path, capsys):
    # the README's old example: save_ops without the selective mode is a config error, printed or not
    bad = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "dump"),
           "--activation_checkpoint.save_ops", "mm,attention", "--job.print_config", "true"]
    r = _cli(bad)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: activation_checkpoint.save_ops: "), r.stderr
    with pytest.raises(SystemExit) as exc:  # run_train.sh's preflight: the same line, and no launch after it
        run_with_config_errors(preflight.main, ["--world-size", "2", *bad])
    assert exc.value.code == 2 and capsys.readouterr().err.strip() == lines[0]
    with pytest.raises(SystemExit) as exc:  # a valid job: printed once by preflight, nothing launched
        run_with_config_errors(preflight.main, ["--world-size", "2", *bad[:4], "--job.print_config", "true"])
    assert exc.value.code == preflight.NOTHING_TO_LAUNCH and "[activation_checkpoint]" in capsys.readouterr().out
    assert not (tmp_path / "dump").exists()


def test_save_ops_that_save_nothing_are_named_once_at_start(tmp_path, caplog):
    run(_cfg(tmp_path, "--training.steps", "1", "--training.seq_len", "32", "--validation.enable", "false",
             "--memory.track", "off", "--metrics.enable_tensorboard", "false", "--activation_checkpoint.mode",
             "selective", "--activation_checkpoint.save_ops", "attention"))
    named = [r.getMessage() for r in caplog.records if "activation_checkpoint.save_ops" in r.getMessage()]
    assert len(named) == 1 and "'attention' saves nothing here (on CPU in float32" in named[0], named
    assert 'as with mode = "full"' in named[0]


@pytest.mark.slow
def test_run_train_sh_end_to_end_and_preflight(tmp_path):
    r = _cli(["--training.steps", "2", "--training.seq_len", "32", "--job.dump_folder", str(tmp_path / "ok")],
             cmd=["./run_train.sh"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step    2" in r.stderr + r.stdout
    bad = _cli(["--parallelism.data_parallel_shard_degree", "3", "--job.dump_folder", str(tmp_path / "bad")],
               env_extra={"NGPU": "2"}, cmd=["./run_train.sh"])
    progress, *lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and progress.startswith("preflight: checking ") and len(lines) == 1, bad.stderr
    assert not (tmp_path / "bad").exists()
