"""The job config: one dataclass per TOML section, loaded from defaults < TOML < command line.

Every field carries its documentation as an attribute docstring (a string literal on the line after the
field). `--help` reads those docstrings from this module's source, so the help text and the code cannot drift
apart. Allowed values live in field metadata (`choices`, numeric bounds) and one generic checker enforces
them, so adding a knob means adding one field, not another `if`.

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

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from parallelisms.activation_checkpoint import ac_config_problem
from parallelisms.moe_comm.registry import COMM_BACKENDS, backend_save_ops, get_comm_backend
from trainer.registry import get_model_spec

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims

T = TypeVar("T")


class ConfigError(Exception):
    """A user-facing config mistake, rendered as one line: `config error: <key>: <problem>; allowed: ...`.

    `key` names what is wrong (a dotted config key, or `file:line:col` for malformed TOML), `problem` says
    what, and `allowed` (optional) says what would be accepted instead. `where` (optional, `file:line`) is the
    place in a TOML file that set the key; it is printed in front of the key.
    """

    def __init__(self, key: str, problem: str, allowed: str | None = None, where: str | None = None):
        self.key = key
        self.problem = problem
        self.allowed = allowed
        self.where = where
        line = f"config error: {where + ': ' if where else ''}{key}: {problem}"
        if allowed:
            line += f"; allowed: {allowed}"
        # One line on purpose: run_with_config_errors promises a single stderr line, and a TOML decoder
        # message or a path could otherwise smuggle in a newline.
        super().__init__(" ".join(line.split()))


def _opt(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    item_choices: Sequence[str] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    special: int | None = None,
    cli_only: bool = False,
) -> Any:
    """A dataclass field whose allowed values are data that `_check_field` enforces.

    `special` is one sentinel value (e.g. -1 = "auto") accepted outside the numeric bounds. `cli_only` marks
    fields that describe this invocation rather than the job; they are rejected in a TOML file and left out
    of `config_to_toml`.
    """
    meta = {
        "choices": choices,
        "item_choices": item_choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "special": special,
        "cli_only": cli_only,
    }
    # Identity tests: a bound of 0 compares equal to False and must survive.
    meta = {k: v for k, v in meta.items() if v is not None and v is not False}
    if isinstance(default, list):
        # A fresh list per instance: configs must never share mutable defaults.
        return field(default_factory=functools.partial(list, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSection:
    """Where outputs go and what this invocation does."""

    config_file: str = _opt("", cli_only=True)
    """Path of the TOML file that was loaded (set only by `--job.config_file PATH`; empty = defaults only)."""
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes: checkpoints, tensorboard logs, memory reports."""
    description: str = ""
    """Free-text description of the job, shown in logs."""
    print_config: bool = _opt(False, cli_only=True)
    """Print the merged config (defaults < TOML < CLI) as TOML and exit with status 0 without training."""


@dataclass
class ModelSection:
    """Which model to build."""

    name: str = "deepseek_v3"
    """Model family, looked up in the model registry."""
    flavor: str = "debugmodel"
    """Named size preset of the model family (e.g. debugmodel, 16B, 671B)."""
    hf_config_path: str = ""
    """Optional Hugging Face config.json; when set, model args come from it instead of the flavor."""
    n_layers: int = _opt(0, ge=1, special=0)
    """Number of transformer layers, overriding the flavor's (or the HF config's); 0 = keep it. Cuts a flavor
    to a benchmarkable size with its real layer shapes (train_configs/h100_bench.toml: 16B with 4 layers)."""
    n_dense_layers: int = _opt(-1, ge=0, special=-1)
    """How many of the first layers use a dense FFN instead of MoE, overriding the flavor's; -1 = keep it. At
    most n_layers."""


@dataclass
class TrainingSection:
    """Length of the run, batch geometry and numerics."""

    steps: int = _opt(10, ge=1)
    """Number of optimizer steps to run."""
    local_batch_size: int = _opt(8, ge=1)
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int = _opt(-1, ge=1, special=-1)
    """Sequences per optimizer step over all ranks; -1 = local_batch_size * data-parallel degree. A larger
    multiple of that product turns the remainder into gradient accumulation."""
    seq_len: int = _opt(2048, ge=1)
    """Tokens per sequence."""
    max_norm: float = _opt(1.0, ge=0)
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    seed: int = 0
    """Random seed for weight init and data order."""
    deterministic: bool = False
    """Use deterministic algorithms (slower) so two runs with the same seed match bit for bit."""
    dtype: str = _opt("float32", choices=["float32", "bfloat16"])
    """Compute dtype of forward and backward; master weights and optimizer state always stay float32."""
    mixed_precision_reduce: str = _opt("float32", choices=["float32", "bfloat16"])
    """Dtype in which data-parallel gradient reductions are done."""
    on_nonfinite: str = _opt("skip", choices=["skip", "stop"])
    """What a step with a NaN/Inf loss or grad norm does: skip (no optimizer update, one warning naming the step)
    or stop (the run ends with one line naming the step)."""


@dataclass
class OptimizerSection:
    """The optimizer and its hyperparameters."""

    name: str = _opt("AdamW", choices=["AdamW"])
    """Optimizer class."""
    lr: float = _opt(8e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = _opt(0.9, ge=0, lt=1)
    """Decay rate of the first-moment (mean) estimate."""
    beta2: float = _opt(0.95, ge=0, lt=1)
    """Decay rate of the second-moment (variance) estimate."""
    eps: float = _opt(1e-8, gt=0)
    """Added to the denominator for numerical stability."""
    weight_decay: float = _opt(0.1, ge=0)
    """Decoupled weight decay coefficient."""
    implementation: str = _opt("fused", choices=["foreach", "for-loop", "fused"])
    """Kernel strategy of the optimizer step: fused (one kernel per tensor, no step-wide temporaries; faster than
    foreach, see docs/performance.md), multi-tensor foreach, or one tensor at a time."""
    max_group_bytes: int = _opt(0, ge=0)
    """0 = step all parameters at once; >0 = tiled step over parameter groups of at most this many bytes,
    which caps the temporary memory of the foreach kernels (fused and for-loop have none to cap)."""


@dataclass
class LRSchedulerSection:
    """Learning-rate schedule: linear warmup, then an optional stable phase, then decay."""

    warmup_steps: int = _opt(2, ge=0)
    """Steps of linear warmup from near zero to the peak learning rate."""
    decay_type: str = _opt("linear", choices=["linear", "cosine", "wsd"])
    """Shape of the decay after warmup; wsd (warmup-stable-decay) holds the peak, then decays linearly."""
    decay_ratio: float = _opt(1.0, gt=0, le=1)
    """Fraction of the post-warmup steps spent decaying; with wsd the peak is held for the steps before."""
    min_lr_factor: float = _opt(0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


@dataclass
class DatasetSection:
    """Where training text comes from."""

    name: str = "pydoc"
    """Built-in corpus shipped with the repo (pydoc), or a Hugging Face hub dataset name."""
    path: str = ""
    """Local json/jsonl/parquet/txt file or directory; overrides name when set."""
    split: str = "train"
    """Dataset split to read."""
    streaming: bool = True
    """Stream the dataset instead of downloading and materialising it first."""
    text_field: str = "text"
    """Name of the column that holds the raw text."""
    allow_download: bool = False
    """Let a Hugging Face dataset name be fetched from the Hub. false: Hugging Face runs offline (the shipped
    corpus, local files and datasets already in the local HF cache); an exported HF_HUB_OFFLINE=1 keeps a run
    offline even when true."""


@dataclass
class TokenizerSection:
    """The tokenizer."""

    path: str = "assets/tokenizer/pydoc_bpe.tiktoken"
    """A tiktoken rank file or a Hugging Face tokenizer.json."""


@dataclass
class MetricsSection:
    """Logging of loss, throughput and memory."""

    log_freq: int = _opt(1, ge=1)
    """Log metrics every this many steps."""
    enable_tensorboard: bool = True
    """Write tensorboard event files under dump_folder."""
    save_for_all_ranks: bool = False
    """Write metrics from every rank, not just rank 0 (useful to see per-rank memory or imbalance)."""


@dataclass
class ParallelismSection:
    """Parallel degrees and their knobs. Expert parallelism borrows ranks from the data-parallel shard
    dimension; it is not an extra factor of the world size."""

    data_parallel_replicate_degree: int = _opt(1, ge=1)
    """Number of data-parallel replicas (the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = _opt(-1, ge=1, special=-1)
    """FSDP shard degree; -1 = all ranks left after data_parallel_replicate_degree and pipeline_parallel_degree."""
    expert_parallel_degree: int = _opt(1, ge=1)
    """Ranks that split the routed experts between them; must divide data_parallel_shard_degree."""
    expert_parallel_comm_backend: str = _opt("alltoall", choices=COMM_BACKENDS)
    """How tokens travel to their experts: a comm backend registered in parallelisms/moe_comm/ (alltoall =
    all_to_all_single collectives; each backend's doc is listed in docs/parallelism.md)."""
    pipeline_parallel_degree: int = _opt(1, ge=1)
    """Number of ranks the model is split across as a pipeline (the pipeline depth)."""
    pipeline_parallel_schedule: str = _opt(
        "1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]
    )
    """Pipeline schedule; GPipe and 1F1B run one stage per rank, Interleaved1F1B several, ZBVZeroBubble and
    DualPipeV exactly two in a V shape."""
    pipeline_parallel_microbatch_size: int = _opt(1, ge=1)
    """Sequences per pipeline microbatch; local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = _opt(-1, ge=1, special=-1)
    """Transformer blocks per pipeline stage; -1 = derive from the schedule and the model depth."""
    pipeline_parallel_module_fqns_per_stage: list[str] = _opt([])
    """Explicit split, one entry per stage with module names separated by spaces
    (e.g. "tok_embeddings layers.0"); empty = automatic split."""
    fsdp_reshard_after_forward: str = _opt("default", choices=["default", "always", "never"])
    """Free unsharded parameters after forward (always) to save memory, or keep them for backward (never);
    default = always without pipeline parallelism, never with it."""
    dry_run: bool = False
    """Build meshes and the sharded model on a fake process group, report, and exit without training."""


@dataclass
class ActivationCheckpointSection:
    """Activation checkpointing: what to keep from forward and what to recompute in backward."""

    mode: str = _opt("none", choices=["none", "full", "selective"])
    """none keeps all activations, full recomputes whole blocks, selective follows the knobs below."""
    granularity: str = _opt("op", choices=["op", "layer"])
    """With selective mode: op saves the outputs of save_ops and recomputes the rest; layer checkpoints
    every layer_freq-th block fully."""
    layer_freq: int = _opt(2, ge=1)
    """With granularity=layer, checkpoint every n-th block."""
    save_ops: list[str] = field(default_factory=lambda: [
        "mm", "grouped_mm", "attention", "all_to_all", "reduce_scatter", "max", "topk", *backend_save_ops(),
        "d2h_copy"])
    """Op names whose outputs selective op-level checkpointing saves instead of recomputing (expensive
    compute, collectives, the registered comm backends' dispatch/combine ops and host copies)."""
    force_recompute_modules: list[str] = _opt(["moe.router.gate"])
    """Module names whose matmuls are recomputed even though mm is in save_ops."""
    recompute_modules: list[str] = _opt([])
    """Megatron-style names of submodules to recompute (e.g. core_attn, moe_act, mla_up_proj)."""
    early_stop: bool = False
    """Stop recomputation once every needed tensor is rebuilt; off because it leaked memory together with
    EP all-to-all (torchtitan #1467)."""


@dataclass
class CompileSection:
    """torch.compile."""

    enable: bool = False
    """Compile the components listed in components."""
    components: list[str] = _opt(["model", "loss"], item_choices=["model", "loss"])
    """What to compile: the transformer blocks (model) and/or the loss."""
    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class CheckpointSection:
    """Saving and loading distributed checkpoints."""

    enable: bool = False
    """Save checkpoints and resume from the latest one found in folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = _opt(500, ge=1)
    """Save every this many steps."""
    keep_latest_k: int = _opt(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: str = _opt("disabled", choices=["disabled", "async"])
    """disabled saves synchronously; async writes in the background while training continues."""
    load_step: int = _opt(-1, ge=0, special=-1)
    """Step to resume from; -1 = the latest checkpoint in folder."""
    last_save_model_only: bool = False
    """Save only model weights (no optimizer or data state) at the last step, for export."""
    export_dtype: str = _opt("float32", choices=["float32", "bfloat16"])
    """Dtype of the weights in a model-only last save."""
    initial_load_path: str = ""
    """Checkpoint to initialise the model from when folder holds no checkpoint yet."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors checkpoint rather than a native one."""


@dataclass
class MoESection:
    """Mixture-of-experts training knobs."""

    load_balance_coeff: float = _opt(1e-3, ge=0)
    """Step size of the aux-loss-free expert-bias update; 0 disables the update."""
    aux_loss_coeff: float = _opt(0.0, ge=0)
    """Weight of the DeepSeek-V3 sequence-wise balance loss; 0 disables it."""
    use_grouped_mm: bool = True
    """Run the routed experts as one grouped matmul instead of a loop over experts."""


@dataclass
class Fp8Section:
    """FP8 compute for the linears and routed experts of the transformer blocks (docs/fp8.md)."""

    recipe: str = _opt("none", choices=["none", "rowwise", "blockwise"])
    """e4m3 inputs for every GEMM of the selected modules: blockwise (DeepSeek-V3: 1x128 activation tiles,
    128x128 weight blocks) or rowwise (one scale per row; linears via torchao); none = high precision."""
    modules: list[str] = _opt(["attention", "feed_forward", "moe.experts", "moe.shared_experts"])
    """Modules inside the blocks whose linears (and grouped experts) convert: names or dotted parts of their
    block-relative names (e.g. attention, wo, moe.experts). Router gate, norms, attention core, embedding and
    output head always stay high precision."""
    exclude_modules: list[str] = _opt(["attention.wkv_a"])
    """Modules left out of modules, same naming (wkv_a's output, kv_lora_rank + qk_rope_head_dim = 576 in the
    DeepSeek flavors, is not a multiple of 128)."""


@dataclass
class ValidationSection:
    """Periodic evaluation on held-out data."""

    enable: bool = False
    """Run validation during training."""
    freq: int = _opt(10, ge=1)
    """Validate every this many steps."""
    steps: int = _opt(2, ge=1)
    """Batches per validation run."""
    dataset: str = ""
    """Dataset name or path; empty = the training dataset."""
    split: str = "validation"
    """Split of the validation dataset."""
    hold_out_every: int = _opt(25, ge=2)
    """Local files have no validation split: with dataset.path set, validation.dataset empty and validation.split
    "validation", validation reads every this many-th document of the training files and training skips them."""


@dataclass
class MemorySection:
    """Memory tracking and leak detection."""

    track: str = _opt("auto", choices=["auto", "exact", "off"])
    """auto = exact on CPU and cheap allocator statistics on CUDA; exact = account every tensor on any device
    (slower); off = no tracking."""
    fail_on_leak: bool = False
    """Stop the run with an error when memory grows from step to step instead of only reporting it."""
    leak_warmup_steps: int = _opt(5, ge=0)
    """Steps the leak detector ignores at the start, while optimizer state and caches are created."""
    leak_window: int = _opt(10, ge=3, special=0)
    """Steps the leak detector fits its slope over; 0 = no leak detection. The alarm needs the slope above
    the threshold for half a window in a row. A leak that grows only every k steps (e.g. only in validation)
    is caught when the window is at least 2 * k."""
    leak_threshold_MiB_per_step: float = _opt(0.1, gt=0)
    """Growth of the memory allocated at step end above which the detector reports a leak (0.1 MiB/step
    adds up to about 10 GiB over 100k steps; a healthy run measures 0)."""
    snapshot_freq: int = _opt(0, ge=0)
    """Write a memory snapshot to dump_folder/memory_snapshots every this many steps; 0 = off. CUDA: an
    allocator snapshot with allocation history and stack traces (recorded from the start when > 0; open in
    pytorch.org/memory_viz); CPU: the exact tracker's table as JSON."""
    dump_on_leak: bool = True
    """Write a memory snapshot when the leak detector raises its alarm."""


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


# ---------------------------------------------------------------------------------------------------------
# Schema introspection


def _sections() -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(_sections()[section])}


@functools.cache
def field_docs() -> dict[str, dict[str, str]]:
    """Attribute docstrings of every section, `{section: {key: doc}}`, read from this module's source."""
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    by_class: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
        by_class[node.name] = docs
    return {name: by_class.get(cls.__name__, {}) for name, cls in _sections().items()}


_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list[str]: "list[str]"}


def _allowed(f: dataclasses.Field) -> str | None:
    """Human description of the values a field accepts, or None when any value of its type is fine."""
    meta = f.metadata
    if "choices" in meta:
        return ", ".join(str(c) for c in meta["choices"])
    if "item_choices" in meta:
        return "items from " + ", ".join(meta["item_choices"])
    bounds = [
        f"{op} {_fmt_num(meta[k])}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta
    ]
    if not bounds:
        return None
    text = " and ".join(bounds)
    if "special" in meta:
        text = f"{meta['special']} or {text}"
    return text


def _expected(f: dataclasses.Field) -> str:
    """What a value of this field looks like, for type errors: e.g. `int >= 1`, `one of float32, bfloat16`."""
    allowed = _allowed(f)
    if f.type is bool:
        return "true or false"
    if "choices" in f.metadata:
        return f"one of {allowed}"
    if f.type == list[str]:
        return "comma-separated " + (allowed if allowed else "strings")
    return f"{_TYPE_NAMES[f.type]} {allowed}" if allowed else _TYPE_NAMES[f.type]


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ---------------------------------------------------------------------------------------------------------
# Type coercion and value checks


def _coerce(key: str, f: dataclasses.Field, value: Any) -> Any:
    """Type-check a TOML value (or an already-parsed CLI value) against the field type."""
    want = _TYPE_NAMES[f.type]
    ok = False
    if f.type is bool:
        ok = isinstance(value, bool)
    elif f.type is int:
        # bool is a subclass of int in Python; `steps = true` is still a mistake.
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif f.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(key, f"expected a finite float, got {value!r}", _expected(f))
    elif f.type is str:
        ok = isinstance(value, str)
    elif f.type == list[str]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if ok:
            value = list(value)
    if not ok:
        raise ConfigError(key, f"expected {want}, got {value!r} ({type(value).__name__})", _expected(f))
    return value


_INT_RE = re.compile(r"[+-]?\d+")
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _parse_cli_value(key: str, f: dataclasses.Field, raw: str) -> Any:
    """Parse one command-line string strictly into the field type (no `1_000`, no `yes`)."""
    want = _TYPE_NAMES[f.type]
    if f.type is bool:
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
    elif f.type is int:
        if _INT_RE.fullmatch(raw):
            return int(raw)
    elif f.type is float:
        if _FLOAT_RE.fullmatch(raw):
            return float(raw)
    elif f.type is str:
        return raw
    elif f.type == list[str]:
        if raw == "":
            return []
        items = [item.strip() for item in raw.split(",")]
        if any(not item for item in items):
            raise ConfigError(key, f"empty item in list {raw!r}", "comma-separated names, e.g. a,b,c")
        return items
    raise ConfigError(key, f"expected {want}, got {raw!r}", _expected(f))


def _check_field(key: str, f: dataclasses.Field, value: Any) -> None:
    """Enforce the choices and bounds stored in the field metadata."""
    meta = f.metadata
    allowed = _allowed(f)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(key, f"{value!r} is not a valid choice", allowed)
    if "item_choices" in meta:
        for item in value:
            if item not in meta["item_choices"]:
                raise ConfigError(key, f"{item!r} is not a valid item", ", ".join(meta["item_choices"]))
    if "special" in meta and value == meta["special"]:
        return
    out_of_range = (
        ("ge" in meta and value < meta["ge"])
        or ("gt" in meta and value <= meta["gt"])
        or ("le" in meta and value > meta["le"])
        or ("lt" in meta and value >= meta["lt"])
    )
    if out_of_range:
        raise ConfigError(key, f"{value!r} is out of range", allowed)


def check_fields(cfg: JobConfig) -> None:
    """Check every field of `cfg` against its choices and bounds; raises ConfigError on the first violation.

    `load_config` runs this; call it yourself on a JobConfig built or edited in code.
    """
    for section in _sections():
        obj = getattr(cfg, section)
        for name, f in _fields(section).items():
            key = f"{section}.{name}"
            _check_field(key, f, _coerce(key, f, getattr(obj, name)))


# ---------------------------------------------------------------------------------------------------------
# Name lookup with suggestions


def _unknown_section(name: str) -> ConfigError:
    sections = list(_sections())
    hint = difflib.get_close_matches(name, sections, n=1)
    if hint:
        problem = f"unknown section; did you mean {hint[0]}?"
    else:
        # A key written without its section (`steps = 10` at the top of a TOML) is a common slip.
        owners = [s for s in sections if name in _fields(s)]
        problem = f"unknown section; did you mean {owners[0]}.{name}?" if owners else "unknown section"
    return ConfigError(name, problem, ", ".join(sections))


def _lookup(section: str, name: str) -> dataclasses.Field:
    """The field for `section.name`, or a ConfigError with a did-you-mean suggestion."""
    if section not in _sections():
        raise _unknown_section(section)
    fields = _fields(section)
    if name in fields:
        return fields[name]
    hint = difflib.get_close_matches(name, list(fields), n=1)
    suggestion = f"{section}.{hint[0]}" if hint else None
    if suggestion is None:
        # Right key, wrong section (e.g. training.lr for optimizer.lr).
        owners = [s for s in _sections() if name in _fields(s)]
        suggestion = f"{owners[0]}.{name}" if owners else None
    if suggestion is None:
        everything = [f"{s}.{k}" for s in _sections() for k in _fields(s)]
        close = difflib.get_close_matches(f"{section}.{name}", everything, n=1)
        suggestion = close[0] if close else None
    problem = "unknown key" + (f"; did you mean {suggestion}?" if suggestion else "")
    raise ConfigError(f"{section}.{name}", problem, f"keys of [{section}]: " + ", ".join(fields))


# ---------------------------------------------------------------------------------------------------------
# Command line


def _split_cli(argv: Sequence[str]) -> list[tuple[str, str, Any]]:
    """Parse `--section.key value`, `--section.key=value` and bare boolean flags into typed overrides."""
    overrides: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ConfigError(token, "unexpected argument", "--section.key value or --section.key=value")
        body = token[2:]
        dotted, has_value, raw = body.partition("=")
        section, dot, name = dotted.partition(".")
        if not dot or not section or not name:
            raise ConfigError(token, "expected --section.key", "--section.key value or --section.key=value")
        key = f"{section}.{name}"
        f = _lookup(section, name)
        if not has_value:
            if i < len(argv) and not argv[i].startswith("--"):
                raw = argv[i]
                i += 1
            elif f.type is bool:
                raw = "true"
            else:
                raise ConfigError(key, "missing value on the command line", _expected(f))
        overrides.append((section, name, _parse_cli_value(key, f, raw)))
    return overrides


def help_text() -> str:
    """Every key as `--section.key (type, default X): docstring`, grouped by section."""
    docs = field_docs()
    lines = ["Options (precedence: defaults < TOML from --job.config_file < command line):"]
    for section, cls in _sections().items():
        lines.append("")
        lines.append(f"[{section}] {(cls.__doc__ or '').strip()}")
        instance = cls()
        for name, f in _fields(section).items():
            default = _toml_value(getattr(instance, name))
            text = docs[section].get(name, "")
            allowed = _allowed(f)
            if allowed:
                text += f" Allowed: {allowed}."
            entry = f"  --{section}.{name} ({_TYPE_NAMES[f.type]}, default {default}): {text}"
            lines.append(textwrap.fill(entry, width=110, subsequent_indent=" " * 6, break_on_hyphens=False))
    lines.append("")
    lines.append("Syntax: --section.key value | --section.key=value; lists as a,b,c (empty = []); booleans as")
    lines.append("true/false, a bare --section.flag means true.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# TOML


def _decode_error_position(err: Exception, text: str) -> tuple[int, int]:
    """Line and column of a TOMLDecodeError: attributes on new Pythons, parsed from the message on 3.11-3.13."""
    lineno, colno = getattr(err, "lineno", None), getattr(err, "colno", None)
    if lineno is not None and colno is not None:
        return lineno, colno
    match = re.search(r"line (\d+), column (\d+)", str(err))
    if match:
        return int(match.group(1)), int(match.group(2))
    # "(at end of document)": the position is just past the last character.
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _read_toml(path: str) -> tuple[dict[str, Any], str]:
    """The parsed TOML document at `path` and its text (kept to point later errors at a line)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError("job.config_file", f"file not found: {path}", "a path to an existing TOML file") from None
    except OSError as err:
        raise ConfigError("job.config_file", f"cannot read {path}: {err.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"malformed TOML: not UTF-8 at byte {err.start}") from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as err:
        lineno, colno = _decode_error_position(err, text)
        # Strip the position suffix the 3.11 decoder appends; it is now in the key as file:line:col.
        reason = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)$", "", str(err))
        raise ConfigError(
            f"{path}:{lineno}:{colno}", f"malformed TOML at line {lineno}, column {colno}: {reason}"
        ) from None


_TOML_KEY_PART = r"""[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*'"""
_TOML_DOTTED_KEY = rf"(?:{_TOML_KEY_PART})(?:\s*\.\s*(?:{_TOML_KEY_PART}))*"
_TOML_TABLE_LINE = re.compile(rf"\s*\[\s*({_TOML_DOTTED_KEY})\s*\]")
_TOML_KEY_LINE = re.compile(rf"\s*({_TOML_DOTTED_KEY})\s*=")


def _key_parts(dotted: str) -> tuple[str, ...]:
    return tuple(part.strip("\"'") for part in re.findall(_TOML_KEY_PART, dotted))


def _toml_key_line(text: str, key_path: tuple[str, ...]) -> int | None:
    """1-based line of the TOML `text` that sets `key_path` (`(section,)` or `(section, key)`), or None.

    tomllib reports no positions for keys, so the lines are scanned: a table header sets the current table (and
    is the line of a section or key it starts with), and a key line matches when its full dotted path and
    `key_path` agree as far as both go (`training = { ... }` sets training.steps, `optimizer.training.x = 1` sets
    optimizer.training). Lines inside multi-line strings are not told apart; the first match wins.
    """
    table: tuple[str, ...] = ()
    for lineno, line in enumerate(text.split("\n"), 1):
        header = _TOML_TABLE_LINE.match(line)
        if header:
            table = _key_parts(header.group(1))
            if table[:len(key_path)] == key_path:
                return lineno
            continue
        key = _TOML_KEY_LINE.match(line)
        if key:
            full = table + _key_parts(key.group(1))
            depth = min(len(full), len(key_path))
            if full[:depth] == key_path[:depth]:
                return lineno
    return None


@contextlib.contextmanager
def _located(path: str, text: str, key_path: tuple[str, ...]):
    """Re-raise a ConfigError about `key_path` with the file and line of the TOML text that set it."""
    try:
        yield
    except ConfigError as err:
        line = _toml_key_line(text, key_path)
        where = f"{path}:{line}" if line is not None else path
        raise ConfigError(err.key, err.problem, err.allowed, where=where) from None


def _toml_values(doc: dict[str, Any], path: str, text: str) -> dict[str, dict[str, Any]]:
    """Check a parsed TOML document against the schema and return `{section: {key: typed value}}`.

    A mistake is reported with the file `path` and the line of `text` where the offending key is set.
    """
    values: dict[str, dict[str, Any]] = {}
    for section, table in doc.items():
        with _located(path, text, (section,)):
            if section not in _sections():
                raise _unknown_section(section)
            if not isinstance(table, dict):
                raise ConfigError(section, f"expected a table [{section}], got {table!r}", f"[{section}] with keys")
        for name, value in table.items():
            key = f"{section}.{name}"
            with _located(path, text, (section, name)):
                f = _lookup(section, name)
                if f.metadata.get("cli_only"):
                    raise ConfigError(key, "can only be set on the command line", f"--{key} on the command line")
                values.setdefault(section, {})[name] = _coerce(key, f, value)
    return values


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            # TOML forbids raw control characters in basic strings.
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        # repr of a finite float is a valid TOML float (e.g. 0.0008, 1e-08) and round-trips exactly.
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def config_to_toml(cfg: JobConfig) -> str:
    """Render `cfg` as a TOML document that `load_config` reads back to an equal config.

    Command-line-only fields (job.config_file, job.print_config) are left out: they describe one invocation,
    and the loader sets job.config_file to the path it actually read.
    """
    lines = ["# Merged job config (defaults < TOML < command line). Load it with --job.config_file PATH."]
    for section in _sections():
        lines.append("")
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        for name, f in _fields(section).items():
            if not f.metadata.get("cli_only"):
                lines.append(f"{name} = {_toml_value(getattr(obj, name))}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Entry points


def load_config(argv: Sequence[str]) -> JobConfig:
    """Build the JobConfig from dataclass defaults < the TOML named by `--job.config_file` < CLI overrides.

    `--help`/`-h` anywhere prints every key and raises SystemExit(0). Mistakes raise ConfigError. Checks that
    need the world size live in `validate_job`; checks that need the model live in the model spec.
    """
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    overrides = _split_cli(argv)
    config_file = ""
    for section, name, value in overrides:
        if (section, name) == ("job", "config_file"):
            config_file = value
    values: dict[str, dict[str, Any]] = {}
    if config_file:
        doc, text = _read_toml(config_file)
        values = _toml_values(doc, config_file, text)
    for section, name, value in overrides:
        values.setdefault(section, {})[name] = value
    cfg = JobConfig(**{section: cls(**values.get(section, {})) for section, cls in _sections().items()})
    check_fields(cfg)
    return cfg


_SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def validate_job(cfg: JobConfig, world_size: int) -> "ParallelDims":
    """Cross-section checks that need the world size but not the model; returns the resolved ParallelDims.

    Model-dependent checks (experts divisible by EP, seq_len within the model's limit, layers per stage) are
    the model spec's job; only the names of `activation_checkpoint.recompute_modules` are checked here, against
    the table the spec exposes.
    """
    # Imported here because parallel_dims imports ConfigError from this module.
    from parallelisms.parallel_dims import ParallelDims

    check_fields(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    tr, par = cfg.training, cfg.parallelism

    per_step = tr.local_batch_size * dims.dp
    if tr.global_batch_size != -1 and tr.global_batch_size % per_step:
        raise ConfigError(
            "training.global_batch_size",
            f"{tr.global_batch_size} is not a multiple of local_batch_size ({tr.local_batch_size}) * "
            f"data-parallel degree ({dims.dp}) = {per_step}",
            f"-1 or a multiple of {per_step}",
        )

    comm_problem = get_comm_backend(par.expert_parallel_comm_backend).config_problem(cfg, dims)
    if comm_problem is not None:
        raise ConfigError(*comm_problem)

    fqns = par.pipeline_parallel_module_fqns_per_stage
    if not dims.pp_enabled:
        if fqns:
            raise ConfigError(
                "parallelism.pipeline_parallel_module_fqns_per_stage",
                "set but pipeline_parallel_degree is 1",
                "[] unless pipeline_parallel_degree > 1",
            )
    else:
        _validate_pipeline(cfg, dims.pp)

    ckpt = cfg.checkpoint
    if ckpt.initial_load_in_hf and not ckpt.initial_load_path:
        raise ConfigError(
            "checkpoint.initial_load_in_hf", "true but checkpoint.initial_load_path is empty", "a path to load from"
        )
    if cfg.compile.enable and not cfg.compile.components:
        raise ConfigError(
            "compile.components", "empty while compile.enable is true, so nothing would compile", "model, loss"
        )
    if cfg.compile.enable and cfg.memory.track == "exact":
        raise ConfigError("memory.track", "exact tracking makes compiled code run eagerly (it would silently "
                          "measure an uncompiled run)", "auto or off with compile.enable = true")
    if cfg.compile.enable and "model" in cfg.compile.components and not cfg.moe.use_grouped_mm:
        raise ConfigError("moe.use_grouped_mm", "the per-expert loop syncs with the host and cannot be compiled",
                          "true with compile.components containing model")
    if not cfg.dataset.name and not cfg.dataset.path:
        raise ConfigError("dataset.name", "empty and dataset.path is empty too", "a dataset name or a dataset.path")
    ac_problem = ac_config_problem(cfg.activation_checkpoint, _recompute_modules(cfg.model.name),
                                   compile_model=cfg.compile.enable and "model" in cfg.compile.components)
    if ac_problem is not None:
        raise ConfigError(*ac_problem)
    return dims


def _recompute_modules(model_name: str):
    """The model spec's recompute-name table (no model is built), or None for a model the registry does not know:
    `trainer.train.prepare` reports that one."""
    try:
        return get_model_spec(model_name).recompute_modules
    except KeyError:
        return None


def _validate_pipeline(cfg: JobConfig, pp: int) -> None:
    """Pipeline checks that follow from the schedule and the batch geometry alone."""
    tr, par = cfg.training, cfg.parallelism
    mbs = par.pipeline_parallel_microbatch_size
    if tr.local_batch_size % mbs:
        raise ConfigError(
            "training.local_batch_size",
            f"{tr.local_batch_size} is not a multiple of parallelism.pipeline_parallel_microbatch_size ({mbs})",
            f"a multiple of {mbs}",
        )
    schedule = par.pipeline_parallel_schedule
    fqns = par.pipeline_parallel_module_fqns_per_stage
    if fqns and par.pipeline_parallel_layers_per_stage != -1:
        raise ConfigError(
            "parallelism.pipeline_parallel_layers_per_stage",
            "set together with pipeline_parallel_module_fqns_per_stage; they both define the split",
            "-1 when pipeline_parallel_module_fqns_per_stage is set",
        )
    if fqns:
        n = len(fqns)
        if schedule in _SINGLE_STAGE_SCHEDULES:
            ok, want = n == pp, f"exactly {pp} entries (one stage per rank with {schedule})"
        elif schedule in _V_SCHEDULES:
            ok, want = n == 2 * pp, f"exactly {2 * pp} entries (two stages per rank with {schedule})"
        else:
            ok = n % pp == 0 and n >= 2 * pp
            want = f"a multiple of {pp} entries, at least {2 * pp} (several stages per rank with {schedule})"
        if not ok:
            raise ConfigError("parallelism.pipeline_parallel_module_fqns_per_stage", f"has {n} entries", want)
    if schedule == "DualPipeV":
        microbatches = tr.local_batch_size // mbs
        if microbatches < 2 * pp:
            raise ConfigError(
                "training.local_batch_size",
                f"gives {microbatches} pipeline microbatches but DualPipeV needs at least one per stage ({2 * pp})",
                f"local_batch_size >= {2 * pp * mbs}",
            )
        if cfg.activation_checkpoint.mode != "none":
            raise ConfigError(
                "activation_checkpoint.mode",
                f"{cfg.activation_checkpoint.mode!r} cannot be combined with the DualPipeV schedule",
                "none with DualPipeV",
            )


def run_with_config_errors(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn(*args, **kwargs)`; on ConfigError print its one line to stderr and exit with status 2.

    Entry points wrap their main with this so a config mistake ends the run with a readable line instead of
    a traceback. Other exceptions propagate untouched.
    """
    try:
        return fn(*args, **kwargs)
    except ConfigError as err:
        message = str(err)
    # Exit outside the except block so the SystemExit carries no chained ConfigError context.
    print(message, file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m trainer.config [--job.config_file F] [overrides]`: check a config and print it merged."""
    cfg = load_config(sys.argv[1:] if argv is None else argv)
    print(config_to_toml(cfg), end="")


if __name__ == "__main__":
    run_with_config_errors(main)
