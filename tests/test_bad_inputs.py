"""Bad-input sweep: every case ends with exit code 2 and one line naming the problem, before anything is written.

Runs the same entry point as `run_train.sh` (`trainer.preflight`) in-process for speed; `tests/test_train.py`
checks the real command lines (subprocess, exit code, stderr) for a few of the same cases.
"""

import hashlib
import json
import os
import sys

import pytest
import torch

from core.config import run_with_config_errors
from trainer.tools.preflight import main as _check

BASE = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--memory.track", "off"]


def _tree_digest(folder) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def good_checkpoint(module_tmp_path):
    """A real 1-step checkpoint of the debug model (in <dump>/checkpoint/step-1)."""
    from trainer.job_config import load_config
    from trainer.train import run

    dump = module_tmp_path / "ckpt"
    run(load_config(BASE + ["--job.dump_folder", str(dump), "--training.steps", "1", "--validation.enable", "false",
                            "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true"]))
    return dump


def _copy_checkpoint(src_dump, dst_dump, mutate=None):
    import shutil

    shutil.copytree(src_dump / "checkpoint", dst_dump / "checkpoint")
    if mutate:
        mutate(dst_dump / "checkpoint" / "step-1")
    return dst_dump


def _truncate_data(ckpt):
    data = [f for f in os.listdir(ckpt) if f.endswith(".distcp")][0]
    with open(ckpt / data, "r+b") as f:
        f.truncate(100)


def _corrupt_metadata(ckpt):
    (ckpt / ".metadata").write_bytes(b"not a pickle")


def _hf_dir_missing_shard(tmp):
    d = tmp / "hf"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    return str(d)


# (id, extra args or a function of tmp_path returning args, world size, substring the one line must contain)
CASES = [
    ("unknown_key", ["--training.stepz", "3"], 1, "training.stepz"),
    ("unknown_section", ["--trainingg.steps", "3"], 1, "trainingg"),
    ("wrong_type", ["--training.steps", "ten"], 1, "training.steps"),
    ("bad_bool", ["--training.deterministic", "maybe"], 1, "training.deterministic"),
    ("zero_steps", ["--training.steps", "0"], 1, "training.steps"),
    ("negative_seq_len", ["--training.seq_len", "-4"], 1, "training.seq_len"),
    ("negative_lr", ["--optimizer.lr", "-1e-3"], 1, "optimizer.lr"),
    ("bad_choice", ["--lr_scheduler.decay_type", "exp"], 1, "lr_scheduler.decay_type"),
    ("degrees_vs_world", ["--parallelism.data_parallel_shard_degree", "3"], 4, "world size is 4"),
    ("ep_not_dividing_shard", ["--parallelism.expert_parallel_degree", "3"], 4, "expert_parallel_degree"),
    ("experts_not_divisible_by_ep", ["--parallelism.data_parallel_shard_degree", "3",
                                     "--parallelism.expert_parallel_degree", "3"], 3, "routed experts"),
    ("seq_len_above_max", ["--training.seq_len", "16384"], 1, ("training.seq_len", "model.max_seq_len")),
    ("cp_seq_len_not_split", ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "34"], 2,
     ("training.seq_len: 34 cannot be split over context_parallel_degree 2", "2 * cp = 4")),
    ("cp_not_dividing_world", ["--parallelism.context_parallel_degree", "2"], 3,
     ("data_parallel_shard_degree: -1 cannot fill the world", "context_parallel_degree")),
    ("global_batch_not_multiple", ["--training.global_batch_size", "3"], 1, "training.global_batch_size"),
    ("unknown_flavor", ["--model.flavor", "huge"], 1, "model.flavor"),
    ("negative_n_layers", ["--model.n_layers", "-2"], 1, "model.n_layers"),
    ("n_dense_layers_above_n_layers", ["--model.n_layers", "2", "--model.n_dense_layers", "3"], 1,
     "model.n_dense_layers: 3 exceeds the model's 2 layers"),
    ("n_layers_below_the_flavors_dense_layers", ["--model.flavor", "671B", "--model.n_layers", "2"], 1,
     "model.n_layers: 2 is fewer than the flavor's 3 dense layers"),
    ("unknown_model", ["--model.name", "llama"], 1, "model.name"),
    ("bad_schedule", ["--parallelism.pipeline_parallel_schedule", "Zigzag"], 2, "pipeline_parallel_schedule"),
    ("bad_ac_op", ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.save_ops", "mm,matmul"],
     1, "save_ops"),
    ("save_ops_without_selective", ["--activation_checkpoint.save_ops", "mm,attention"], 1,
     "activation_checkpoint.save_ops: set, but mode='none'"),
    ("print_config_of_a_bad_job", ["--job.print_config", "true", "--parallelism.expert_parallel_degree", "3"], 4,
     "expert_parallel_degree"),
    ("dualpipev_with_ac", ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                           "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                           "--activation_checkpoint.mode", "full"], 2, "activation_checkpoint.mode"),
    ("zbv_with_selective_ac", ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                               "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                               "--activation_checkpoint.mode", "selective"], 2,
     "cannot be combined with the ZBVZeroBubble schedule"),
    ("zbv_with_full_ac", ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                          "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
                          "--activation_checkpoint.mode", "full"], 2, "weight-gradient pass"),
    ("deepep_without_ep", ["--parallelism.expert_parallel_comm_backend", "deepep"], 1,
     "expert_parallel_comm_backend"),
    ("compile_with_exact_memory", ["--compile.enable", "true", "--memory.track", "exact"], 1, "memory.track"),
    ("missing_dataset_path", ["--dataset.path", "/nonexistent/data.jsonl"], 1, "/nonexistent/data.jsonl"),
    ("missing_tokenizer", ["--tokenizer.path", "/nonexistent/tok.tiktoken"], 1, "tokenizer.path"),
    ("corrupt_tokenizer", lambda tmp: ["--tokenizer.path", str(_write(tmp / "bad.tiktoken", "%%% not base64\n"))],
     1, "tokenizer.path"),
    ("missing_initial_checkpoint", ["--checkpoint.initial_load_path", "/nonexistent/ckpt"], 1, "does not exist"),
    ("hf_dir_missing_shard", lambda tmp: ["--checkpoint.initial_load_in_hf", "true",
                                          "--checkpoint.initial_load_path", _hf_dir_missing_shard(tmp)],
     1, "model-00001-of-00002.safetensors"),
    ("malformed_toml", lambda tmp: ["--job.config_file", str(_write(tmp / "bad.toml", "[training]\nsteps = = 3\n"))],
     1, "bad.toml:2"),
    ("missing_toml", ["--job.config_file", "/nonexistent/job.toml"], 1, "/nonexistent/job.toml"),
    ("wrong_text_field", lambda tmp: ["--dataset.path", _jsonl(tmp / "content.jsonl", "content", 30)],
     1, ("config error: dataset.text_field: ", "no string field 'text'", "have: content")),
    ("unknown_dataset_name", ["--dataset.name", "pydocs"],
     1, ("config error: dataset.name: 'pydocs'", "did you mean 'pydoc'?", "offline", "dataset.allow_download")),
    ("missing_validation_split", ["--validation.split", "test"], 1, ("config error: validation.split: ",
                                                                     "validation.enable = false")),
    ("too_few_documents_to_hold_out", lambda tmp: ["--dataset.path", _jsonl(tmp / "small.jsonl", "text", 10)],
     1, ("config error: validation.hold_out_every: ", "fewer than 25", "validation.enable = false")),
    ("bad_fp8_recipe", ["--fp8.recipe", "tensorwise"], 1, "fp8.recipe"),
    ("fp8_unknown_module", ["--fp8.modules", "attention,router.gate"], 1, "'router.gate'"),
    ("fp8_unknown_exclude", ["--fp8.exclude_modules", "wkv_c"], 1, "fp8.exclude_modules"),
    ("fp8_blockwise_dims", ["--fp8.recipe", "blockwise", "--fp8.exclude_modules", ""], 1,
     "attention.wkv_a has dims (256, 576)"),
    ("fp8_experts_without_grouped_mm", ["--fp8.recipe", "blockwise", "--moe.use_grouped_mm", "false"], 1,
     "moe.use_grouped_mm"),
]


def _jsonl(path, field, n):
    """A jsonl file of n short documents whose text sits in `field`."""
    path.write_text("".join(json.dumps({field: f"Document number {i}, short."}) + "\n" for i in range(n)))
    return str(path)


def _write(path, text):
    path.write_text(text)
    return path


def _expect_one_line_exit_2(argv, world_size, needle, capsys):
    """`needle`: a substring of the one line, or a tuple of substrings it must all contain."""
    with pytest.raises(SystemExit) as exc:
        run_with_config_errors(_check, ["--world-size", str(world_size), *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for part in (needle,) if isinstance(needle, str) else needle:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name, extra, world_size, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, capsys, name, extra, world_size, needle):
    dump = tmp_path / "dump"
    args = extra(tmp_path) if callable(extra) else extra
    _expect_one_line_exit_2(BASE + ["--job.dump_folder", str(dump)] + args, world_size, needle, capsys)
    assert not dump.exists()


def test_deepep_on_cuda_without_deep_ep_names_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError
    dump = tmp_path / "dump"
    line = _expect_one_line_exit_2(BASE + ["--job.dump_folder", str(dump), "--parallelism.expert_parallel_degree", "2",
                                          "--parallelism.expert_parallel_comm_backend", "deepep"],
                                   2, "parallelism.expert_parallel_comm_backend", capsys)
    assert "deep_ep cannot be imported" in line and "docs/deepep.md" in line, line
    assert not dump.exists()


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_on_cpu_with_torch_2_11_are_refused_before_launch(tmp_path, capsys, monkeypatch, schedule):
    """torch 2.11's V-shaped schedules send between the two stages of one rank before the first step, which gloo
    cannot do ("Pair is not connected", seen in tests/test_parallel.py on torch 2.11.0): one line instead."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    dump = tmp_path / "dump"
    line = _expect_one_line_exit_2(BASE + ["--job.dump_folder", str(dump), "--parallelism.pipeline_parallel_degree",
                                          "2", "--training.local_batch_size", "4",
                                          "--parallelism.pipeline_parallel_schedule", schedule],
                                   2, "parallelism.pipeline_parallel_schedule", capsys)
    assert "needs torch 2.13 or later" in line and "GPipe, 1F1B, Interleaved1F1B" in line, line
    assert not dump.exists()


@pytest.mark.parametrize("mutate, needle", [
    (_truncate_data, "truncated"),
    (_corrupt_metadata, "unreadable"),
    (None, "another flavor"),
    (None, "load_step 7 not found"),
], ids=["truncated", "corrupt_metadata", "other_flavor", "missing_load_step"])
def test_bad_checkpoint_leaves_it_untouched(tmp_path, capsys, good_checkpoint, mutate, needle):
    dump = _copy_checkpoint(good_checkpoint, tmp_path / "dump", mutate)
    before = _tree_digest(dump)
    extra = ["--checkpoint.enable", "true"]
    if needle == "another flavor":
        extra += ["--model.hf_config_path", str(_write(tmp_path / "config.json", json.dumps(_other_flavor())))]
    if needle.startswith("load_step"):
        extra += ["--checkpoint.load_step", "7"]
    _expect_one_line_exit_2(BASE + ["--job.dump_folder", str(dump)] + extra, 1, needle, capsys)
    assert _tree_digest(dump) == before


def _other_flavor() -> dict:
    """A HF config for a debug-sized model whose MLA dims differ from the debug flavor's."""
    from models.deepseek_v3.args import FLAVORS
    from models.deepseek_v3.hf import hf_config_from_args

    return hf_config_from_args(FLAVORS["debugmodel"].replace(kv_lora_rank=256), torch.float32)
