"""What a user sees when a run cannot start or stops: the whole output of `./run_train.sh`, read as a user would.

Every failure ends with its one line as the last line printed, no Python traceback, and the exit code of
docs/errors.md; torchrun's own failure report is replaced by one line from `trainer.launch`. Checkpoints whose
weights differ from the model's are refused before launch, unless `checkpoint.allow_partial_load`.
"""

import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_RECORD = re.compile(r"^(\[rank \d+\] )?\d\d:\d\d:\d\d (INFO|WARNING) ")  # ranks other than 0 name themselves
SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "1", "--memory.track", "off",
         "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]


def run_train(tmp_path, *args, ngpu: int = 1, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./run_train.sh", *SMALL, "--job.dump_folder", str(tmp_path / "dump"), *args], cwd=REPO,
                          env=dict(os.environ, NGPU=str(ngpu), **env), capture_output=True, text=True, timeout=600)


def assert_ends_with_one_line(result, code: int, *contains: str) -> str:
    """The run ended with `code`, its last line holds every string of `contains`, no traceback anywhere, and besides
    the trainer's log records only preflight's first line and that last line: the line once, whatever the ranks."""
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    for text in contains:
        assert text in last, last
    others = [line for line in result.stderr.strip().splitlines() if not LOG_RECORD.match(line)]
    assert len(others) == 2 and others[0].startswith("preflight: checking "), others
    return last


@pytest.fixture(scope="module")
def transformers_checkpoint(module_tmp_path):
    """A tiny DeepseekV3ForCausalLM saved by transformers: its config.json declares one MTP layer
    (num_nextn_predict_layers = 1), its safetensors hold none (transformers' model has no MTP)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.DeepseekV3Config(
        vocab_size=2048, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, max_position_embeddings=256, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    path = module_tmp_path / "hf"
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return path


@pytest.mark.slow
def test_transformers_checkpoint_names_the_mtp_switch_then_trains_with_it(tmp_path, transformers_checkpoint):
    hf = ["--model.hf_config_path", str(transformers_checkpoint / "config.json"),
          "--checkpoint.initial_load_path", str(transformers_checkpoint), "--checkpoint.initial_load_in_hf", "true",
          "--training.steps", "1"]
    refused = run_train(tmp_path, *hf)
    assert_ends_with_one_line(refused, 2, "lacks model.layers.3.*", "--model.mtp_layers 0")
    assert not (tmp_path / "dump").exists()
    trained = run_train(tmp_path, *hf, "--model.mtp_layers", "0")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "initial weights loaded from HF checkpoint" in trained.stderr + trained.stdout
    assert f"model deepseek_v3 (HF config {transformers_checkpoint / 'config.json'})" in trained.stderr


@pytest.mark.slow
def test_deeper_checkpoint_is_refused_unless_a_partial_load_is_asked_for(tmp_path):
    """A 6-layer checkpoint into a 4-layer model: refused for an initial load and for a resume, one line naming
    layers 4 and 5; with checkpoint.allow_partial_load the run starts from it and says what it skipped."""
    six = tmp_path / "six"
    saved = subprocess.run(["./run_train.sh", *SMALL, "--job.dump_folder", str(six), "--training.steps", "1",
                            "--checkpoint.enable", "true"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert saved.returncode == 0, saved.stderr[-2000:]
    step1 = str(six / "checkpoint" / "step-1")
    initial = run_train(tmp_path, "--model.n_layers", "4", "--training.steps", "1",
                        "--checkpoint.initial_load_path", step1)
    assert_ends_with_one_line(initial, 2, "layers.4.*, layers.5.* (30 weights)", "checkpoint.allow_partial_load")
    resume = subprocess.run(["./run_train.sh", *SMALL, "--job.dump_folder", str(six), "--training.steps", "2",
                             "--checkpoint.enable", "true", "--model.n_layers", "4"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert_ends_with_one_line(resume, 2, "layers.4.*, layers.5.*")
    partial = run_train(tmp_path, "--model.n_layers", "4", "--training.steps", "1",
                        "--checkpoint.initial_load_path", step1, "--checkpoint.allow_partial_load", "true")
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert "partial load of" in partial.stderr and "skipped layers.4.*, layers.5.* (30 weights)" in partial.stderr


@pytest.mark.slow
def test_non_finite_stop_on_two_ranks_ends_with_one_line(tmp_path):
    result = run_train(tmp_path, "--training.steps", "3", "--training.on_nonfinite", "stop", "--optimizer.lr",
                       "1e38", ngpu=2)
    last = assert_ends_with_one_line(result, 1, "run failed on rank", "training error: step 2: non-finite")
    assert "training.on_nonfinite = stop" in last


@pytest.mark.slow
def test_document_without_the_text_field_names_its_line_document_step_and_fields(tmp_path):
    data = tmp_path / "docs.jsonl"
    with open(data, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"short document {i} with a few words"} if i != 30 else {"body": "x"}) + "\n")
    result = run_train(tmp_path, "--training.steps", "30", "--dataset.path", str(data), ngpu=2)
    last = assert_ends_with_one_line(result, 2, "data error at step", "dataset.text_field",
                                     f"{data} line 31 (document 30) has no string field 'text' (its fields: body)")
    assert "fields: text, body" not in last
    # once: the launcher's line (every rank hits the same document; before, each rank printed it too)
    assert (result.stdout + result.stderr).count("has no string field") == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_broken_json_row_names_its_line_and_document_in_one_line(tmp_path):
    """Found in preflight (the loader reads the file): one line naming the file's line 31 and document 30, and no
    line of the datasets library before it."""
    data = tmp_path / "broken.jsonl"
    rows = [json.dumps({"text": f"document {i}"}) for i in range(60)]
    rows[30] = '{"text": "broken'
    data.write_text("\n".join(rows) + "\n")
    from trainer.data.config import DatasetError
    from trainer.data.sources import load_documents

    class Dataset:
        name, path, text_field = "", str(data), "text"

    with pytest.raises(DatasetError) as info:
        source = load_documents(Dataset, "train")
        list(source.iter_texts(0))
    assert f"{data} line 31 (document 30) is not valid JSON" in info.value.problem
    result = subprocess.run(["./run_train.sh", *SMALL, "--job.dump_folder", str(tmp_path / "d"), "--dataset.path",
                             str(data)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert_ends_with_one_line(result, 2, "line 31 (document 30) is not valid JSON")
    # preflight: what it checks while it loads (10-25 s on a busy machine), then nothing but the line
    first, last = result.stderr.strip().splitlines()
    assert first.startswith("preflight: checking the config, model, tokenizer, data and checkpoints"), first


LEAKY_RANK = '''
"""Imported at interpreter start (sitecustomize): the torchrun worker whose RANK is LEAK_RANK keeps 1 MiB more
alive after every training batch it reads, a leak the trainer knows nothing about."""
import os

if "LEAK_RANK" in os.environ and os.environ.get("RANK") == os.environ["LEAK_RANK"]:
    import torch

    from trainer.data import loader

    kept = []
    next_batch = loader.PackedDataLoader.next_batch

    def leaky_next_batch(self):
        kept.append(torch.empty(1 << 18))
        return next_batch(self)

    loader.PackedDataLoader.next_batch = leaky_next_batch
'''


@pytest.mark.slow
def test_leak_on_one_rank_stops_the_run_with_one_line_after_logging_the_alarm(tmp_path):
    """Rank 1 of 2 leaks 1 MiB per step (a module patched in at interpreter start, not a hook of the trainer); with
    memory.fail_on_leak the run ends with the leak's line naming the rank, exit code 1, and rank 1's tensorboard
    already holds the alarm's step."""
    from trainer.memory.leak_detector import ALARM_RANK_TAG, ALARM_TAG, SLOPE_TAG
    from trainer.memory.ranks import read_worst_ranks
    from trainer.metrics import read_scalars, run_dirs

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(LEAKY_RANK)
    result = run_train(tmp_path, "--training.steps", "10", "--model.n_layers", "1", "--memory.track", "exact",
                       "--memory.fail_on_leak", "true", "--memory.leak_warmup_steps", "1", "--memory.leak_window", "3",
                       "--memory.dump_on_leak", "false", "--metrics.enable_tensorboard", "true",
                       "--metrics.save_for_all_ranks", "true",
                       ngpu=2, LEAK_RANK="1", PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), REPO]))
    # the alarm: warm-up 1 + window 3 + the confirmation span 1 - 1 = step 4
    assert_ends_with_one_line(result, 1, "run failed on rank 1: training error: rank 1: memory leak: memory allocated "
                              "at step end grows 1 MiB/step (Theil-Sen slope over steps 2-4",
                              "set memory.fail_on_leak = false to only warn")
    run_dir = run_dirs(str(tmp_path / "dump" / "tb"))[-1]
    scalars = read_scalars(os.path.join(run_dir, "rank_1"))
    assert scalars[ALARM_TAG] == [(4, 1.0)]
    # 1 MiB/step, plus the 9 bytes of each step's loss, grad norm and flag kept on the device until a logging step
    assert scalars[SLOPE_TAG][-1] == (4, pytest.approx(1.0, abs=1e-4))
    assert max(step for step, _ in scalars["memory/allocated_GiB"]) == 4
    # rank 0's run folder names the rank too: the alarm with its rank, and rank 1 holding the most at step end
    run = read_scalars(run_dir)
    assert run[ALARM_TAG] == [(4, 1.0)] and run[ALARM_RANK_TAG] == [(4, 1.0)]
    assert read_worst_ranks(run_dir)["memory/allocated_GiB"][-1] == (4, 1) and max(step for step, _ in run["loss"]) == 4


def test_save_ops_warning_at_start_names_only_a_users_list_with_ops_this_run_never_runs(tmp_path, caplog):
    """README: only a save_ops list other than the default is judged; a name the device, dtype or EP setup never
    dispatches is named at start (model-dependent names such as max are not judged), and a list left with nothing
    that saves adds that every op is recomputed as with full AC."""
    from types import SimpleNamespace

    import torch

    from trainer.job_config import load_config, validate_job
    from trainer.prepare import warn_settings_without_effect

    def warnings(*args: str) -> list[str]:
        cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                           str(tmp_path), "--activation_checkpoint.mode", "selective", *args])
        caplog.clear()
        warn_settings_without_effect(SimpleNamespace(cfg=cfg, dims=validate_job(cfg, 1)), torch.device("cpu"))
        return [record.getMessage() for record in caplog.records]

    assert warnings() == []  # the default list names ops of every device and layout on purpose
    assert warnings("--activation_checkpoint.save_ops", "mm,max") == []
    assert warnings("--activation_checkpoint.save_ops", "mm,attention,all_to_all") == [
        "activation_checkpoint.save_ops: 'attention' saves nothing here (on CPU in float32 attention takes SDPA's "
        "math path: its bmm count as 'mm' and its softmax as 'softmax', no fused attention op runs); 'all_to_all' "
        "saves nothing here (no expert parallelism (parallelism.expert_parallel_degree = 1) exchanges no tokens)"]
    assert warnings("--activation_checkpoint.save_ops", "mm,attention", "--training.dtype", "bfloat16") == []
    alone, = warnings("--activation_checkpoint.save_ops", "attention")
    assert alone.endswith('every op is recomputed as with mode = "full", at the higher cost of the selective policy')


def test_force_recompute_modules_is_judged_against_the_whole_model_and_only_when_the_user_set_it(caplog):
    """Under pipeline parallelism a stage may hold only the dense first block, which has no 'moe.router.gate' (the
    model's default force_recompute_modules): applying AC to that stage warns about nothing. A name the user set is
    judged once against the whole model (every stage's blocks): warned about only when no block has it."""
    import torch

    from models.deepseek_v3.model import DeepSeekV3Model
    from models.deepseek_v3.parallelize import checkpoint_model
    from models.deepseek_v3.pipeline import keep_stage
    from parallelisms.activation_checkpoint.config import ActivationCheckpointSection
    from small_models import SMALL

    with torch.device("meta"):
        model = DeepSeekV3Model(SMALL)  # layer 0 dense, layers 1-2 MoE
    for names in (["default"], ["moe.router"], ["default", "attention"]):
        ac = ActivationCheckpointSection(mode="selective", force_recompute_modules=names)
        caplog.clear()
        with caplog.at_level("WARNING"):
            checkpoint_model(keep_stage(model, ["tok_embeddings", "layers.0"]), ac)
        assert not [r.getMessage() for r in caplog.records if "force_recompute_modules" in r.getMessage()], names

    from parallelisms.activation_checkpoint.policy import force_modules_warning

    for names in (["default"], ["moe.router"], ["gate", "default", "attention.wkv_a"]):
        ac = ActivationCheckpointSection(mode="selective", force_recompute_modules=names)
        assert force_modules_warning(ac, model) is None, names
    ac = ActivationCheckpointSection(mode="selective", force_recompute_modules=["default", "moe.routr", "atention"])
    warning = force_modules_warning(ac, model)
    assert warning.startswith("activation_checkpoint.force_recompute_modules: 'moe.routr', 'atention' match no "
                              "module of the model's blocks (names or dotted parts of: "), warning
    assert "moe.router.gate" in warning and "layers." not in warning  # names inside a block, as the key takes them
