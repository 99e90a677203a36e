"""Tests of the job config (TOML + CLI loading, errors, help, printing) and of ParallelDims."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parallelisms.moe_comm.registry import op_table
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallel_dims import ParallelismSection
from core.config import ConfigError, check_sections, config_to_toml, field_docs, load, run_with_config_errors
from trainer.job_config import JobConfig, load_config, validate_job

REPO = Path(__file__).resolve().parents[1]


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    message = str(info.value)
    assert message.startswith("config error: ")
    assert "\n" not in message
    return message


def all_keys() -> list[str]:
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(JobConfig)
        for f in dataclasses.fields(section.type)
    ]


# --- loading -------------------------------------------------------------------------------------------


def test_defaults_load():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.training.steps == 10
    assert cfg.job.config_file == ""
    # module names and save ops default to "default": the model's and the op table's lists, resolved where read
    assert cfg.activation_checkpoint.force_recompute_modules == ["default"]
    assert cfg.activation_checkpoint.save_ops == ["default"]
    assert cfg.fp8.modules == cfg.fp8.exclude_modules == ["default"]
    assert "deepep_dispatch" in op_table().save_ops(cfg.activation_checkpoint.save_ops)


def test_list_defaults_are_not_shared():
    a, b = JobConfig(), JobConfig()
    a.compile.components.append("extra")
    assert b.compile.components == ["model", "loss"]


def test_every_field_has_a_docstring():
    docs = field_docs(JobConfig)
    for key in all_keys():
        section, name = key.split(".")
        assert docs[section].get(name), f"{key} has no attribute docstring"


def test_toml_load(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [training]
        steps = 3
        max_norm = 2          # an int where a float is expected is fine
        dtype = "bfloat16"
        [optimizer]
        lr = 1e-3
        [activation_checkpoint]
        save_ops = ["mm"]
        """,
    )
    cfg = load_config(["--job.config_file", path])
    assert cfg.job.config_file == path
    assert cfg.training.steps == 3
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.training.dtype == "bfloat16"
    assert cfg.optimizer.lr == 1e-3
    assert cfg.activation_checkpoint.save_ops == ["mm"]
    assert cfg.training.seq_len == 2048  # untouched keys keep their defaults


def test_cli_overrides_toml(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 3\nseq_len = 64\n")
    cfg = load_config([f"--job.config_file={path}", "--training.steps", "7"])
    assert cfg.training.steps == 7
    assert cfg.training.seq_len == 64
    # Order on the command line does not matter: the CLI always wins over the TOML.
    cfg = load_config(["--training.steps=9", "--job.config_file", path])
    assert cfg.training.steps == 9


def test_cli_value_forms():
    cfg = load_config(
        [
            "--optimizer.lr=0.5",
            "--optimizer.eps",
            "1e-6",
            "--training.max_norm",
            "3",
            "--training.seed",
            "-5",
            "--job.description=a=b",
            "--training.steps",
            "4",
            "--training.steps",
            "5",
        ]
    )
    assert cfg.optimizer.lr == 0.5
    assert cfg.optimizer.eps == 1e-6
    assert cfg.training.max_norm == 3.0
    assert cfg.training.seed == -5
    assert cfg.job.description == "a=b"
    assert cfg.training.steps == 5  # last one wins


def test_list_parsing():
    cfg = load_config(["--compile.components", "loss", "--activation_checkpoint.save_ops=mm, topk ,max"])
    assert cfg.compile.components == ["loss"]
    assert cfg.activation_checkpoint.save_ops == ["mm", "topk", "max"]
    cfg = load_config(["--activation_checkpoint.force_recompute_modules="])
    assert cfg.activation_checkpoint.force_recompute_modules == []
    cfg = load_config(["--activation_checkpoint.force_recompute_modules", ""])
    assert cfg.activation_checkpoint.force_recompute_modules == []
    message = config_error(["--activation_checkpoint.save_ops", "mm,,topk"])
    assert "activation_checkpoint.save_ops" in message


def test_bool_parsing():
    cfg = load_config(["--compile.enable", "TRUE", "--dataset.streaming=False"])
    assert cfg.compile.enable is True
    assert cfg.dataset.streaming is False
    # A bare flag means true, whether followed by another key or at the very end.
    cfg = load_config(["--compile.enable", "--training.steps", "2", "--checkpoint.enable"])
    assert cfg.compile.enable is True and cfg.checkpoint.enable is True
    assert cfg.training.steps == 2
    message = config_error(["--compile.enable", "yes"])
    assert "compile.enable" in message and "true or false" in message


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, key, expected",
    [
        (["--training.steps", "ten"], "training.steps", "expected int, got 'ten'"),
        (["--training.steps", "1.5"], "training.steps", "expected int"),
        (["--training.steps", "1_000"], "training.steps", "expected int"),
        (["--optimizer.lr", "fast"], "optimizer.lr", "expected float"),
        (["--optimizer.lr", "nan"], "optimizer.lr", "expected float"),
    ],
)
def test_cli_wrong_type(argv, key, expected):
    message = config_error(argv)
    assert f": {key}: " in message and expected in message
    assert "allowed:" in message


@pytest.mark.parametrize(
    "argv, key, allowed",
    [
        (["--training.steps", "0"], "training.steps", ">= 1"),
        (["--training.max_norm", "-1"], "training.max_norm", ">= 0"),
        (["--optimizer.lr", "0"], "optimizer.lr", "> 0"),
        (["--optimizer.beta1", "1"], "optimizer.beta1", ">= 0 and < 1"),
        (["--lr_scheduler.decay_ratio", "0"], "lr_scheduler.decay_ratio", "> 0 and <= 1"),
        (["--training.global_batch_size", "0"], "training.global_batch_size", "-1 or >= 1"),
        (["--parallelism.data_parallel_shard_degree", "-2"], "parallelism.data_parallel_shard_degree", "-1 or >= 1"),
        (["--training.dtype", "float16"], "training.dtype", "float32, bfloat16"),
        (
            ["--parallelism.pipeline_parallel_schedule", "1f1b"],
            "parallelism.pipeline_parallel_schedule",
            "GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV",
        ),
        (["--optimizer.implementation", "apex"], "optimizer.implementation", "foreach, for-loop, fused"),
        (["--memory.track", "on"], "memory.track", "auto, exact, off"),
        (["--compile.components", "model,optimizer"], "compile.components", "model, loss"),
    ],
)
def test_out_of_range_and_choices(argv, key, allowed):
    message = config_error(argv)
    assert f": {key}: " in message
    assert message.endswith(f"allowed: {allowed}") or f"allowed: {allowed}" in message


def test_unknown_key_did_you_mean():
    message = config_error(["--training.stepz", "3"])
    assert "training.stepz" in message and "did you mean training.steps?" in message
    assert "allowed: keys of [training]:" in message and "seq_len" in message
    # The right key in the wrong section points to its real home.
    message = config_error(["--training.lr", "1"])
    assert "did you mean optimizer.lr?" in message


def test_unknown_section_did_you_mean(tmp_path):
    message = config_error(["--trainig.steps", "3"])
    assert "config error: trainig: unknown section; did you mean training?" in message
    assert "allowed: job, model, training" in message
    path = write_toml(tmp_path, "steps = 3\n")
    message = config_error(["--job.config_file", path])
    assert "did you mean training.steps?" in message


def test_cli_syntax_errors():
    assert "missing value" in config_error(["--training.steps"])
    assert "missing value" in config_error(["--training.steps", "--optimizer.lr", "1"])
    assert "expected --section.key" in config_error(["--steps", "3"])
    assert "unexpected argument" in config_error(["steps"])


@pytest.mark.parametrize(
    "toml, key, expected",
    [
        ('[training]\nsteps = "ten"\n', "training.steps", "expected int, got 'ten' (str)"),
        ("[training]\nsteps = true\n", "training.steps", "expected int, got True (bool)"),
        ("[training]\nsteps = 2.0\n", "training.steps", "expected int"),
        ("[optimizer]\nlr = true\n", "optimizer.lr", "expected float"),
        ("[compile]\nenable = 1\n", "compile.enable", "expected bool"),
        ("[compile]\ncomponents = \"model\"\n", "compile.components", "expected list[str]"),
        ("[compile]\ncomponents = [1]\n", "compile.components", "expected list[str]"),
        ("[training]\nsteps = 0\n", "training.steps", "out of range"),
        ("[training]\nstep = 1\n", "training.step", "did you mean training.steps?"),
        ("[trainings]\nsteps = 1\n", "trainings", "did you mean training?"),
        ("training = 3\n", "training", "expected a table [training]"),
        ('[job]\nconfig_file = "x.toml"\n', "job.config_file", "only be set on the command line"),
    ],
)
def test_toml_errors(tmp_path, toml, key, expected):
    path = write_toml(tmp_path, toml)
    message = config_error(["--job.config_file", path])
    assert f": {key}: " in message and expected in message
    assert "allowed:" in message


@pytest.mark.parametrize(
    "toml, line, key",
    [
        ("# a comment\n[training]\nsteps = 3\n\n  stepz = 4   # the typo\n", 5, "training.stepz"),
        ("[training]\nsteps = 3\n[optimizer]\n'lr' = 1e-3\n\"betaa\" = 0.9\n", 5, "optimizer.betaa"),
        ("[optimizer]\nlr = 1e-3\ntraining.stepz = 4\n", 3, "optimizer.training"),
        ("training.steps = 3\ntraining . stepz = 4\n", 2, "training.stepz"),
        ("[job]\ndescription = \"x\"\ntraining = { steps = 3, stepz = 4 }\n", 3, "job.training"),
        ("training = { steps = 3, stepz = 4 }\n", 1, "training.stepz"),
        ("[training]\nsteps = 3\n\n[trainings]\nsteps = 1\n", 4, "trainings"),
        ("[training]\nsteps = \"ten\"\nseq_len = 64\n", 2, "training.steps"),
        ("[training]\nseq_len = 64\n[training.sub]\nx = 1\n", 3, "training.sub"),
        # an escaped quoted key is not matched by the line scan: the message still names the file
        ('[training]\n"step\\u007a" = 1\n', None, "training.stepz"),
    ],
)
def test_toml_error_names_file_and_line(tmp_path, toml, line, key):
    path = write_toml(tmp_path, toml)
    message = config_error(["--job.config_file", path])
    where = f"{path}:{line}" if line else path
    assert message.startswith(f"config error: {where}: {key}: "), message


def test_missing_toml(tmp_path):
    message = config_error(["--job.config_file", str(tmp_path / "nope.toml")])
    assert "job.config_file" in message and "file not found" in message and "nope.toml" in message


@pytest.mark.parametrize(
    "toml, line, col",
    [
        ("[training]\nsteps = 3\nseq_len = \n", 3, 11),
        ("[training]\nsteps = 3\n[training]\n", 3, 10),
        ('[job]\ndescription = "unterminated', 2, 28),
    ],
)
def test_malformed_toml_reports_line_and_column(tmp_path, toml, line, col):
    path = write_toml(tmp_path, toml)
    message = config_error(["--job.config_file", path])
    assert f"{path}:{line}:{col}: malformed TOML at line {line}, column {col}" in message


# --- printing and help ---------------------------------------------------------------------------------


def test_print_config_round_trip(tmp_path):
    base = write_toml(tmp_path, '[job]\ndescription = "quote \\" and\\ttab"\n[training]\nsteps = 4\n')
    cfg = load_config(
        [
            "--job.config_file",
            base,
            "--job.print_config",
            "--optimizer.eps=1e-12",
            "--optimizer.lr",
            "0.0003",
            "--activation_checkpoint.save_ops=",
            "--parallelism.pipeline_parallel_module_fqns_per_stage",
            "tok_embeddings layers.0,layers.1 norm output",
            "--dataset.path=C:\\data\\ü.jsonl",
        ]
    )
    assert cfg.job.print_config is True
    printed = tmp_path / "printed.toml"
    printed.write_text(config_to_toml(cfg))
    again = load_config(["--job.config_file", str(printed)])
    # Only the invocation fields differ: the file read and the print action.
    expected = dataclasses.replace(
        cfg, job=dataclasses.replace(cfg.job, config_file=str(printed), print_config=False)
    )
    assert again == expected
    assert again.job.description == 'quote " and\ttab'


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as info:
        load_config(["--training.steps", "3", "-h"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for key in all_keys():
        assert f"--{key} (" in out, key
    assert "--training.steps (int, default 10): Number of optimizer steps" in out
    assert '--training.dtype (str, default "float32")' in out
    assert "--compile.components (list[str], default [\"model\", \"loss\"])" in out
    # Grouped by section, in declaration order.
    assert out.index("[job]") < out.index("[training]") < out.index("[memory]")
    with pytest.raises(SystemExit):
        load_config(["--bogus.key", "--help"])


# --- run_with_config_errors ----------------------------------------------------------------------------


def test_run_with_config_errors_passes_results_through():
    assert run_with_config_errors(lambda x: x + 1, 1) == 2


def test_run_with_config_errors_exits_2_with_one_line(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(
        "import sys\n"
        "from core.config import run_with_config_errors\nfrom trainer.job_config import load_config\n"
        "run_with_config_errors(lambda: load_config(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), "--training.stepz", "3"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: training.stepz: unknown key; did you mean training.steps?")


# --- the machinery on a fork's own sections ------------------------------------------------------------

FORK_SECTIONS = '''
from __future__ import annotations

from dataclasses import dataclass, field

from core.config import ConfigError, option
from trainer.job_config import JobSection


@dataclass
class SamplerSection:
    """How examples are drawn."""

    temperature: float = option(1.0, gt=0)
    """Softmax temperature."""
    mode: str = option("greedy", choices=["greedy", "topk"])
    """Decoding mode."""
    k: int = option(0, ge=0)
    """Candidates kept with mode = topk."""

    def check(self) -> list[ConfigError]:
        if self.mode == "topk" and self.k == 0:
            return [ConfigError("k", "0 with mode = topk", ">= 1 with topk")]
        return []


@dataclass
class ForkConfig:
    job: JobSection = field(default_factory=JobSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
'''


def load_fork_module(tmp_path):
    """A fork's root config and section in their own module, with string annotations (postponed evaluation)."""
    path = tmp_path / "fork_sections.py"
    path.write_text(FORK_SECTIONS)
    spec = importlib.util.spec_from_file_location("fork_sections", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fork_sections"] = module
    spec.loader.exec_module(module)
    return module


def test_machinery_loads_a_section_from_any_module(tmp_path, capsys):
    fork = load_fork_module(tmp_path)
    toml = write_toml(tmp_path, "[sampler]\nmode = \"topk\"\n")
    cfg = load(fork.ForkConfig, ["--job.config_file", toml, "--sampler.temperature", "0.5"])
    assert (cfg.sampler.mode, cfg.sampler.temperature, cfg.sampler.k) == ("topk", 0.5, 0)
    with pytest.raises(ConfigError, match=r"sampler\.k: 0 with mode = topk; allowed: >= 1 with topk"):
        check_sections(cfg)
    with pytest.raises(ConfigError, match=r"sampler\.mode: 'beam' is not a valid choice; allowed: greedy, topk"):
        load(fork.ForkConfig, ["--sampler.mode", "beam"])
    with pytest.raises(ConfigError, match=r"job\.toml:2: sampler\.temprature: unknown key; did you mean "
                                          r"sampler\.temperature\?"):
        load(fork.ForkConfig, ["--job.config_file", write_toml(tmp_path, "[sampler]\ntemprature = 2.0\n")])
    with pytest.raises(SystemExit):
        load(fork.ForkConfig, ["--help"])
    out = capsys.readouterr().out
    assert "--sampler.temperature (float, default 1.0): Softmax temperature. Allowed: > 0." in out
    assert "[sampler]\ntemperature = 0.5\nmode = \"topk\"\nk = 0\n" in config_to_toml(cfg)


def test_machinery_imports_only_the_standard_library():
    code = ("import sys, core.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'parallelisms', 'models', 'trainer', "
            "'core', 'quantization')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("['core', 'core.config', 'core.config.errors', 'core.config.fields', "
                                   "'core.config.loading', 'core.config.render']")


# --- ParallelDims and cross-section validation ---------------------------------------------------------


def par(**kw) -> ParallelismSection:
    return ParallelismSection(**kw)


def test_parallel_dims_fill_and_properties():
    dims = ParallelDims.from_config(par(), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.pp) == (1, 8, 1, 1)
    assert dims.dp == 8 and dims.fsdp_enabled and dims.dp_enabled
    assert not dims.hsdp and not dims.ep_enabled and not dims.pp_enabled

    dims = ParallelDims.from_config(
        par(data_parallel_replicate_degree=2, pipeline_parallel_degree=2, expert_parallel_degree=2), 16
    )
    assert dims.dp_shard == 4 and dims.dp == 8 and dims.efsdp == 2
    assert dims.hsdp and dims.ep_enabled and dims.pp_enabled

    dims = ParallelDims.from_config(par(data_parallel_shard_degree=1), 1)
    assert dims.dp == 1 and not dims.dp_enabled and not dims.fsdp_enabled


def test_parallel_dims_product_mismatch():
    with pytest.raises(ConfigError) as info:
        ParallelDims.from_config(par(data_parallel_replicate_degree=2, data_parallel_shard_degree=2), 8)
    message = str(info.value)
    for part in ("data_parallel_replicate_degree (2)", "data_parallel_shard_degree (2)", "= 4", "world size is 8"):
        assert part in message
    assert "allowed:" in message


def test_parallel_dims_fill_does_not_divide():
    with pytest.raises(ConfigError) as info:
        ParallelDims.from_config(par(pipeline_parallel_degree=4), 6)
    message = str(info.value)
    assert "parallelism.data_parallel_shard_degree" in message and "world size 6" in message
    assert "allowed:" in message


def test_parallel_dims_ep_must_divide_dp_shard():
    with pytest.raises(ConfigError) as info:
        ParallelDims.from_config(par(expert_parallel_degree=4), 6)
    message = str(info.value)
    assert "parallelism.expert_parallel_degree" in message and "data_parallel_shard_degree (6)" in message
    assert "allowed: 1, 2, 3, 6" in message
    # EP is not an extra factor of the world: ep=4 on 4 ranks is fine.
    assert ParallelDims.from_config(par(expert_parallel_degree=4), 4).efsdp == 1


def validate_error(argv: list[str], world_size: int) -> str:
    cfg = load_config(argv)
    with pytest.raises(ConfigError) as info:
        validate_job(cfg, world_size)
    return str(info.value)


def test_validate_job_ok():
    dims = validate_job(load_config(["--training.global_batch_size", "64"]), 4)
    assert dims.dp == 4
    cfg = load_config(
        [
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_microbatch_size=2",
            "--parallelism.pipeline_parallel_module_fqns_per_stage=tok_embeddings layers.0,layers.1 norm output",
        ]
    )
    assert validate_job(cfg, 4).dp_shard == 2


@pytest.mark.parametrize(
    "argv, world_size, key, expected",
    [
        (["--training.global_batch_size", "20"], 4, "training.global_batch_size", "multiple of 32"),
        (
            ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=3"],
            2,
            "training.local_batch_size",
            "multiple of 3",
        ),
        (
            ["--parallelism.pipeline_parallel_module_fqns_per_stage", "layers.0"],
            1,
            "parallelism.pipeline_parallel_module_fqns_per_stage",
            "pipeline_parallel_degree > 1",
        ),
        (
            ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_module_fqns_per_stage=a,b,c"],
            2,
            "parallelism.pipeline_parallel_module_fqns_per_stage",
            "exactly 2 entries",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree=2",
                "--parallelism.pipeline_parallel_module_fqns_per_stage=a,b",
                "--parallelism.pipeline_parallel_layers_per_stage=1",
            ],
            2,
            "parallelism.pipeline_parallel_layers_per_stage",
            "-1 when",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree=4",
                "--parallelism.pipeline_parallel_schedule=DualPipeV",
                "--training.local_batch_size=4",
            ],
            4,
            "training.local_batch_size",
            "local_batch_size >= 8",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree=2",
                "--parallelism.pipeline_parallel_schedule=DualPipeV",
                "--activation_checkpoint.mode=full",
            ],
            2,
            "activation_checkpoint.mode",
            "none with DualPipeV",
        ),
        (["--checkpoint.initial_load_in_hf"], 1, "checkpoint.initial_load_in_hf", "a path"),
        (["--compile.enable", "--compile.components="], 1, "compile.components", "model, loss"),
        (["--dataset.name="], 1, "dataset.name", "dataset.path"),
        (["--parallelism.expert_parallel_degree=3"], 4, "parallelism.expert_parallel_degree", "1, 2, 4"),
    ],
)
def test_validate_job_errors(argv, world_size, key, expected):
    message = validate_error(argv, world_size)
    assert f": {key}: " in message
    assert "allowed:" in message and expected in message
