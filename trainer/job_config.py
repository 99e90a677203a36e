"""The job config: one section dataclass per TOML table, composed into `JobConfig`, and the checks across them.

Each section lives beside the code that reads it (the table in docs/architecture.md, "Config"); this module only
composes them, loads a job (defaults < TOML < command line, through the generic machinery of `core.config`)
and checks what involves more than one section or needs the world size.

Typical use in an entry point::

    def main() -> None:
        cfg = load_config(sys.argv[1:])
        if cfg.job.print_config:
            print(config_to_toml(cfg), end="")
            return
        dims = validate_job(cfg, world_size)
        ...

    if __name__ == "__main__":
        run_with_config_errors(main)
"""

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from core.config import (ConfigError, check_fields, check_sections, config_to_toml, load, option,
                         run_with_config_errors)
from core.model_config import ModelSection, MoESection
from core.model_spec import ModelJob, ParallelizeJob
from parallelisms.activation_checkpoint.config import ActivationCheckpointSection, ac_config_problem
from parallelisms.compile import CompileSection, compiles_model
from parallelisms.moe_comm.registry import get_comm_backend
from parallelisms.parallel_dims import ParallelDims, ParallelismSection
from quantization.fp8.config import Fp8Section
from trainer.checkpoint.config import CheckpointSection
from trainer.data.config import DatasetSection
from trainer.lr_schedule import LRSchedulerSection
from trainer.memory.config import MemorySection
from trainer.metrics import LABEL_MAX, MetricsSection, layout_label
from trainer.optimizer import OptimizerSection
from trainer.registry import get_model_spec
from trainer.tokenizer import TokenizerSection
from trainer.training_config import TrainingSection, ValidationSection
from trainer.watchdog import CommSection


@dataclass
class JobSection:
    """Where outputs go and what this invocation does."""

    config_file: str = option("", cli_only=True)
    """Path of the TOML file that was loaded (set only by `--job.config_file PATH`; empty = defaults only). A
    command given none reads `train_configs/debug_model.toml` (`DEFAULT_CONFIG_FILE`)."""
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes: checkpoints, tensorboard logs, memory reports."""
    description: str = ""
    """Free-text description of the job, shown in logs; given on the command line, it also names the run's
    tensorboard folder (otherwise the keys the command line set do)."""
    print_config: bool = option(False, cli_only=True)
    """Print the merged config (defaults < TOML < CLI) as TOML and exit with status 0 without training."""


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section. Pass components only their own section."""

    job: JobSection = field(default_factory=JobSection)
    """Outputs and invocation."""
    model: ModelSection = field(default_factory=ModelSection)
    """Model selection."""
    training: TrainingSection = field(default_factory=TrainingSection)
    """Run length, batch geometry, numerics."""
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """Optimizer."""
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    """Learning-rate schedule."""
    dataset: DatasetSection = field(default_factory=DatasetSection)
    """Training data."""
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    """Tokenizer."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Metrics logging."""
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    """Parallel degrees."""
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    """Activation checkpointing."""
    compile: CompileSection = field(default_factory=CompileSection)
    """torch.compile."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpointing."""
    moe: MoESection = field(default_factory=MoESection)
    """Mixture of experts."""
    fp8: Fp8Section = field(default_factory=Fp8Section)
    """FP8 training."""
    validation: ValidationSection = field(default_factory=ValidationSection)
    """Validation."""
    memory: MemorySection = field(default_factory=MemorySection)
    """Memory tracking."""
    comm: CommSection = field(default_factory=CommSection)
    """Communication timeouts."""


def load_config(argv: Sequence[str]) -> JobConfig:
    """Build the JobConfig from dataclass defaults < the TOML named by `--job.config_file` < CLI overrides.

    `--help`/`-h` anywhere prints every key and raises SystemExit(0). Mistakes raise ConfigError. Checks that
    need the world size or compare keys live in `validate_job`; checks that need the model live in the model spec.
    """
    return load(JobConfig, argv, config_file_key="job.config_file")


DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"
"""The config of a command that names none: `./run_train.sh` (without CONFIG_FILE), `python -m trainer.train` and
every tool (`trainer.preflight`, `trainer.plan`, `trainer.memory_plan`, `trainer.dry_run`, `trainer.job_config`)
read it, so that a plan or a check without a config is about the run `./run_train.sh` trains. Relative to the
repository root, where the commands run."""


def load_command_config(argv: Sequence[str]) -> JobConfig:
    """`load_config` for a command line: `DEFAULT_CONFIG_FILE` unless `argv` names a config file
    (`--job.config_file ""` reads the dataclass defaults alone)."""
    names_one = any(a == "--job.config_file" or a.startswith("--job.config_file=") for a in argv)
    return load_config(argv if names_one else ["--job.config_file", DEFAULT_CONFIG_FILE, *argv])


#: Sections whose keys come first in a run's label: what shapes memory and speed, the usual subject of a comparison.
_LABEL_FIRST = ("activation_checkpoint", "parallelism", "fp8", "compile", "moe", "model", "training")


def _file_config(cfg: JobConfig) -> JobConfig:
    """The job as its TOML file alone gives it (the defaults without one)."""
    return load_config(["--job.config_file", cfg.job.config_file]) if cfg.job.config_file else JobConfig()


def set_keys(cfg: JobConfig, base: JobConfig | None = None) -> list[tuple[str, object]]:
    """(`section.key`, value) of every key outside `[job]` whose value is not the one the TOML file (or, without
    one, the defaults) gives, `base` (read when not given): what the command line set; the sections of
    `_LABEL_FIRST` first."""
    base = _file_config(cfg) if base is None else base
    changed = []
    first = [s for s in _LABEL_FIRST if hasattr(cfg, s)]
    for section in sorted(fields(cfg), key=lambda f: first.index(f.name) if f.name in first else len(first)):
        if section.name == "job":
            continue
        mine, theirs = getattr(cfg, section.name), getattr(base, section.name)
        changed += [(f"{section.name}.{key.name}", getattr(mine, key.name)) for key in fields(mine)
                    if getattr(mine, key.name) != getattr(theirs, key.name)]
    return changed


#: Keys folded into the three parts every run name holds: the AC mode (with its other keys), the layout, the dtype.
_LAYOUT_KEYS = ("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree",
                "parallelism.pipeline_parallel_degree")
#: Short names of long keys in a run's name.
_SHORT = {"expert_parallel_comm_backend": "comm", "pipeline_parallel_schedule": "pp_schedule"}
#: Settings of a run's length, seed, logging, checkpoints, timeouts and leak detection, not of its model, layout,
#: math or memory measurement: they go last in a run's name, and are the first left out when it is too long.
_INCIDENTAL = ("training.steps", "training.seed", "metrics.", "validation.", "checkpoint.", "comm.", "memory.leak_",
               "memory.snapshot_freq", "memory.dump_on_leak", "memory.fail_on_leak")


def run_name(cfg: JobConfig, dims: ParallelDims) -> str:
    """What tells this run apart from the other runs of its job, as a run folder's label: first what the command
    line set (a `job.description` given there, or the keys it set, as `key=value`: the key's last part, lists joined
    by `+`, paths by their file name, `_SHORT` names for long keys), then always the AC mode, the layout
    (`layout_label` of the resolved `dims`) and the dtype, e.g. `lr=0.001,ac=selective,fsdp4.ep2,bf16`, then
    incidental settings (steps, logging, checkpoints: `_INCIDENTAL`). Whole settings only: those that do not fit `LABEL_MAX`
    are counted as `+N`, incidental ones first."""
    base = _file_config(cfg)
    ac = cfg.activation_checkpoint

    def shown(value: object) -> str:
        if isinstance(value, list):
            return "+".join(map(str, value))
        text = str(value)
        return os.path.basename(text.rstrip("/")) if os.sep in text else text

    first, ac_keys, incidental = [], [], []
    for key, value in set_keys(cfg, base):
        name = key.rpartition(".")[2]
        part = f"{_SHORT.get(name, name)}={shown(value)}"
        if key.startswith("activation_checkpoint."):
            ac_keys += [] if key == "activation_checkpoint.mode" else [part]
        elif key in _LAYOUT_KEYS or key == "training.dtype":
            continue
        elif key.startswith(_INCIDENTAL):
            incidental.append(part)
        else:
            first.append(part)
    kept = [",".join([f"ac={ac.mode}", *ac_keys]), layout_label(dims), _DTYPES.get(cfg.training.dtype,
                                                                                     cfg.training.dtype)]
    if cfg.job.description != base.job.description:  # cut to leave room for the three parts
        first = [cfg.job.description[:max(LABEL_MAX - len(",".join(kept)) - 1, 0)]]
    optional = first + incidental
    for n in range(len(optional), -1, -1):
        more = [f"+{len(optional) - n}"] if n < len(optional) else []
        label = ",".join([*optional[:min(n, len(first))], *kept, *optional[len(first):n], *more])
        if len(label) <= LABEL_MAX or n == 0:
            return label
    raise AssertionError("unreachable: n = 0 returns")


_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def model_job(cfg: JobConfig) -> ModelJob:
    """What a model family reads of the job to build its args (`ModelSpec.build_args`)."""
    par = cfg.parallelism
    return ModelJob(model=cfg.model, moe=cfg.moe, seq_len=cfg.training.seq_len,
                    expert_parallel_degree=par.expert_parallel_degree,
                    pipeline_parallel_degree=par.pipeline_parallel_degree,
                    compile_model=compiles_model(cfg.compile), fp8=cfg.fp8)


def parallelize_job(cfg: JobConfig) -> ParallelizeJob:
    """The sections a model's parallelize plan reads (`ModelSpec.parallelize`)."""
    return ParallelizeJob(parallelism=cfg.parallelism, activation_checkpoint=cfg.activation_checkpoint,
                          compile=cfg.compile, fp8=cfg.fp8, dtype=cfg.training.dtype,
                          reduce_dtype=cfg.training.mixed_precision_reduce)


def validate_job(cfg: JobConfig, world_size: int, fields_checked: bool = False) -> ParallelDims:
    """Each section's own checks, then those across sections and against the world size; returns the resolved
    ParallelDims. `fields_checked`: the caller has checked every key's value against its allowed values (the
    layout planner, which checks them once and then only sets keys to allowed values).

    Model-dependent checks (experts divisible by EP, seq_len within the model's limit, layers per stage) are
    the model spec's job; only the names of `activation_checkpoint.recompute_modules` are checked here, against
    the table the spec exposes.
    """
    if not fields_checked:
        check_fields(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    tr = cfg.training

    per_step = tr.local_batch_size * dims.dp
    if tr.global_batch_size != -1 and tr.global_batch_size % per_step:
        raise ConfigError(
            "training.global_batch_size",
            f"{tr.global_batch_size} is not a multiple of local_batch_size ({tr.local_batch_size}) * "
            f"data-parallel degree ({dims.dp}) = {per_step}",
            f"-1 or a multiple of {per_step}",
        )

    backend = get_comm_backend(cfg.parallelism.expert_parallel_comm_backend)
    comm_problem = backend.config_problem(dims, cfg.activation_checkpoint, cfg.compile)
    if comm_problem is not None:
        raise ConfigError(*comm_problem)

    check_sections(cfg)
    if dims.pp_enabled:
        _validate_pipeline(cfg, dims.pp)
    if dims.cp_enabled:
        _validate_context_parallel(cfg, dims.cp)

    if cfg.compile.enable and cfg.memory.track == "exact":
        raise ConfigError("memory.track", "exact tracking makes compiled code run eagerly (it would silently "
                          "measure an uncompiled run)", "auto or off with compile.enable = true")
    ac_problem = ac_config_problem(cfg.activation_checkpoint, _recompute_modules(cfg.model.name),
                                   compile_model=compiles_model(cfg.compile))
    if ac_problem is not None:
        raise ConfigError(*ac_problem)
    return dims


def _recompute_modules(model_name: str):
    """The model spec's recompute-name table (no model is built), or None for a model the registry does not know:
    `trainer.train.prepare` reports that one."""
    try:
        return get_model_spec(model_name).plan.recompute_modules
    except KeyError:
        return None


def _validate_pipeline(cfg: JobConfig, pp: int) -> None:
    """Pipeline checks that tie the schedule to the batch geometry and to activation checkpointing (the split
    itself is checked by ParallelismSection.check)."""
    tr, par = cfg.training, cfg.parallelism
    mbs = par.pipeline_parallel_microbatch_size
    if tr.local_batch_size % mbs:
        raise ConfigError(
            "training.local_batch_size",
            f"{tr.local_batch_size} is not a multiple of parallelism.pipeline_parallel_microbatch_size ({mbs})",
            f"a multiple of {mbs}",
        )
    if par.pipeline_parallel_schedule == "1F1B" and tr.local_batch_size // mbs < pp:
        # torch's 1F1B refuses fewer microbatches than stages when it is built, after launch
        raise ConfigError(
            "training.local_batch_size",
            f"gives {tr.local_batch_size // mbs} pipeline microbatches but 1F1B needs at least one per stage ({pp})",
            f"local_batch_size >= {pp * mbs}, or parallelism.pipeline_parallel_schedule GPipe or Interleaved1F1B",
        )
    if par.pipeline_parallel_schedule == "DualPipeV":
        microbatches = tr.local_batch_size // mbs
        if microbatches < 2 * pp:
            raise ConfigError(
                "training.local_batch_size",
                f"gives {microbatches} pipeline microbatches but DualPipeV needs at least one per stage ({2 * pp})",
                f"local_batch_size >= {2 * pp * mbs}",
            )
    if par.pipeline_parallel_schedule in ("ZBVZeroBubble", "DualPipeV") and cfg.activation_checkpoint.mode != "none":
        # Both split each backward into an input-gradient and a later weight-gradient autograd pass. torch's
        # non-reentrant checkpoint keeps recomputed activations per autograd pass, so the weight pass would
        # recompute every checkpointed block again, and a per-op SAC region cannot be replayed twice ("Trying to
        # backward an extra time"): refused here instead of crashing in the first backward.
        raise ConfigError(
            "activation_checkpoint.mode",
            f"{cfg.activation_checkpoint.mode!r} cannot be combined with the {par.pipeline_parallel_schedule} "
            "schedule (its separate weight-gradient pass would recompute every checkpointed block a second time)",
            f"none with {par.pipeline_parallel_schedule}, or parallelism.pipeline_parallel_schedule 1F1B or "
            "Interleaved1F1B with activation checkpointing",
        )


def _validate_context_parallel(cfg: JobConfig, cp: int) -> None:
    """Context parallelism against the sequence geometry and the model family (parallelisms/context_parallel.py)."""
    seq_len = cfg.training.seq_len
    if seq_len % (2 * cp):
        raise ConfigError(
            "training.seq_len",
            f"{seq_len} cannot be split over context_parallel_degree {cp}: the load-balanced split cuts every "
            f"sequence into 2 * cp = {2 * cp} equal chunks",
            f"a multiple of {2 * cp} (e.g. {seq_len // (2 * cp) * 2 * cp or 2 * cp}), or a context_parallel_degree "
            f"whose double divides {seq_len}",
        )
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError:
        return  # `trainer.prepare` names the unknown model
    if not spec.context_parallel:
        raise ConfigError("parallelism.context_parallel_degree",
                          f"model {cfg.model.name!r} cannot split its sequences over ranks", "1")


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m trainer.job_config [--job.config_file F] [overrides]`: check a config and print it merged."""
    cfg = load_command_config(sys.argv[1:] if argv is None else argv)
    print(config_to_toml(cfg), end="")


if __name__ == "__main__":
    run_with_config_errors(main)
