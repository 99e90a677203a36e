"""Parallel degrees resolved against the world size, checked once before any mesh or model is built.

The world is `pp * dp_replicate * dp_shard * cp` ranks. Context parallelism (`cp`) splits every sequence over
its ranks; to everything but attention its ranks are data-parallel ranks holding other tokens, so FSDP shards the
weights over `dp_shard * cp`. Expert parallelism does not add a factor: EP borrows ranks from that shard dimension
("dp2ep", tokens are tokens to the MoE layer), so `dp_shard * cp = efsdp * ep` where `efsdp` is the FSDP degree
left over for the expert weights.
"""

from dataclasses import dataclass

from parallelisms.moe_comm.registry import COMM_BACKENDS
from core.config import ConfigError, option

_SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


@dataclass
class ParallelismSection:
    """Parallel degrees and their knobs. Expert parallelism borrows ranks from the data-parallel shard and
    context-parallel dimensions; it is not an extra factor of the world size."""

    data_parallel_replicate_degree: int = option(1, ge=1)
    """Number of data-parallel replicas (the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = option(-1, ge=1, special=-1)
    """Data-parallel shard degree; -1 = all ranks left after data_parallel_replicate_degree,
    context_parallel_degree and pipeline_parallel_degree."""
    context_parallel_degree: int = option(1, ge=1)
    """Ranks that split every sequence between them (load-balanced causal split: rank i holds chunks i and
    2 * cp - 1 - i of 2 * cp); training.seq_len must be a multiple of 2 * cp. FSDP shards over
    data_parallel_shard_degree * context_parallel_degree."""
    expert_parallel_degree: int = option(1, ge=1)
    """Ranks that split the routed experts between them; must divide data_parallel_shard_degree *
    context_parallel_degree."""
    expert_parallel_comm_backend: str = option("alltoall", choices=COMM_BACKENDS)
    """How tokens travel to their experts: a comm backend registered in parallelisms/moe_comm/ (alltoall =
    all_to_all_single collectives; each backend's doc is listed in docs/parallelism.md)."""
    pipeline_parallel_degree: int = option(1, ge=1)
    """Number of ranks the model is split across as a pipeline (the pipeline depth)."""
    pipeline_parallel_schedule: str = option(
        "1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]
    )
    """Pipeline schedule; GPipe and 1F1B run one stage per rank, Interleaved1F1B several, ZBVZeroBubble and
    DualPipeV exactly two in a V shape."""
    pipeline_parallel_microbatch_size: int = option(1, ge=1)
    """Sequences per pipeline microbatch; local_batch_size must be a multiple of it."""
    pipeline_parallel_layers_per_stage: int = option(-1, ge=1, special=-1)
    """Transformer blocks per pipeline stage; -1 = derive from the schedule and the model depth."""
    pipeline_parallel_module_fqns_per_stage: list[str] = option([])
    """Explicit split, one entry per stage with module names separated by spaces
    (e.g. "tok_embeddings layers.0"); empty = automatic split."""
    fsdp_reshard_after_forward: str = option("default", choices=["default", "always", "never"])
    """Free unsharded parameters after forward (always) to save memory, or keep them for backward (never);
    default = always without pipeline parallelism, never with it."""
    auto: bool = False
    """Let the layout planner (`python -m trainer.plan`) choose the layout before launch: pipeline degree and
    schedule, replicate x shard, EP degree and backend, resharding and activation checkpointing mode; the keys of
    these that the TOML or the command line set keep their values. Prints the chosen layout in one line."""
    auto_device_memory_gib: float = option(0.0, ge=0)
    """Memory per rank the auto layout must fit, in GiB; 0 = measure it (the GPU's total memory; on CPU the
    host's memory divided by the ranks)."""
    dry_run: bool = False
    """Build meshes and the sharded model on a fake process group, report, and exit without training."""

    def check(self) -> list[ConfigError]:
        """Settings of this section that contradict each other: the explicit pipeline split against the degree,
        the schedule and the layers-per-stage knob."""
        fqns, pp, schedule = (self.pipeline_parallel_module_fqns_per_stage, self.pipeline_parallel_degree,
                              self.pipeline_parallel_schedule)
        if not fqns:
            return []
        if pp == 1:
            return [ConfigError("pipeline_parallel_module_fqns_per_stage", "set but pipeline_parallel_degree is 1",
                                "[] unless pipeline_parallel_degree > 1")]
        if self.pipeline_parallel_layers_per_stage != -1:
            return [ConfigError("pipeline_parallel_layers_per_stage",
                                "set together with pipeline_parallel_module_fqns_per_stage; they both define the split",
                                "-1 when pipeline_parallel_module_fqns_per_stage is set")]
        n = len(fqns)
        if schedule in _SINGLE_STAGE_SCHEDULES:
            ok, want = n == pp, f"exactly {pp} entries (one stage per rank with {schedule})"
        elif schedule in _V_SCHEDULES:
            ok, want = n == 2 * pp, f"exactly {2 * pp} entries (two stages per rank with {schedule})"
        else:
            ok = n % pp == 0 and n >= 2 * pp
            want = f"a multiple of {pp} entries, at least {2 * pp} (several stages per rank with {schedule})"
        return [] if ok else [ConfigError("pipeline_parallel_module_fqns_per_stage", f"has {n} entries", want)]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees. Construction checks that they tile the world; use `from_config`."""

    dp_replicate: int
    """Data-parallel replicas (HSDP replicate dimension)."""
    dp_shard: int
    """Data-parallel shard degree (resolved, never -1); FSDP shards dense weights over dp_shard * cp."""
    ep: int
    """Expert-parallel degree, carved out of dp_shard * cp."""
    pp: int
    """Pipeline-parallel degree."""
    world_size: int
    """Total number of ranks."""
    cp: int = 1
    """Context-parallel degree: ranks that split every sequence."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError("world_size", f"{self.world_size} is not a positive number of ranks", ">= 1")
        for key, value in (
            ("parallelism.data_parallel_replicate_degree", self.dp_replicate),
            ("parallelism.data_parallel_shard_degree", self.dp_shard),
            ("parallelism.expert_parallel_degree", self.ep),
            ("parallelism.pipeline_parallel_degree", self.pp),
            ("parallelism.context_parallel_degree", self.cp),
        ):
            if value < 1:
                raise ConfigError(key, f"{value} is out of range", ">= 1")
        product = self.dp_replicate * self.dp_shard * self.cp * self.pp
        if product != self.world_size:
            cp = f" * context_parallel_degree ({self.cp})" if self.cp > 1 else ""
            raise ConfigError(
                "parallelism",
                f"data_parallel_replicate_degree ({self.dp_replicate}) * data_parallel_shard_degree "
                f"({self.dp_shard}){cp} * pipeline_parallel_degree ({self.pp}) = {product}, "
                f"but the world size is {self.world_size}",
                f"degrees whose product is {self.world_size}, or data_parallel_shard_degree = -1 to fill the rest",
            )
        if self.fsdp_shard % self.ep:
            span = (f"data_parallel_shard_degree ({self.dp_shard}) * context_parallel_degree ({self.cp}) = "
                    f"{self.fsdp_shard}" if self.cp > 1 else f"data_parallel_shard_degree ({self.dp_shard})")
            raise ConfigError(
                "parallelism.expert_parallel_degree",
                f"{self.ep} does not divide {span}; EP borrows ranks from the data-parallel shard "
                "dimension, it is not an extra factor of the world size",
                _divisors(self.fsdp_shard),
            )

    @classmethod
    def from_config(cls, parallelism_cfg: ParallelismSection, world_size: int) -> "ParallelDims":
        """Resolve `data_parallel_shard_degree = -1` to the ranks left over and check the degrees."""
        dp_replicate = parallelism_cfg.data_parallel_replicate_degree
        pp = parallelism_cfg.pipeline_parallel_degree
        cp = parallelism_cfg.context_parallel_degree
        dp_shard = parallelism_cfg.data_parallel_shard_degree
        if dp_shard == -1:
            rest = dp_replicate * pp * cp
            if rest < 1 or world_size % rest:
                names = "data_parallel_replicate_degree * pipeline_parallel_degree"
                values = f"({dp_replicate}) * ({pp})"
                if cp > 1:
                    names, values = names + " * context_parallel_degree", values + f" * ({cp})"
                raise ConfigError(
                    "parallelism.data_parallel_shard_degree",
                    f"-1 cannot fill the world: world size {world_size} is not divisible by {names} = "
                    f"{values} = {rest}",
                    f"{names} among {_divisors(world_size)}",
                )
            dp_shard = world_size // rest
        return cls(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=parallelism_cfg.expert_parallel_degree,
            pp=pp,
            world_size=world_size,
            cp=cp,
        )

    @property
    def dp(self) -> int:
        """Total data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards the dense weights over: dp_shard * cp (context-parallel ranks hold other tokens)."""
        return self.dp_shard * self.cp

    @property
    def token_ranks(self) -> int:
        """Ranks of one pipeline stage that hold different tokens (dp * cp): the ranks gradients, token counts and
        loss sums are summed over."""
        return self.dp * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert weights: the shard ranks not used for expert parallelism."""
        return self.fsdp_shard // self.ep

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel rank."""
        return self.dp > 1

    @property
    def sharded(self) -> bool:
        """FSDP applies: more than one rank holds other tokens (dp * cp > 1)."""
        return self.token_ranks > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Dense weights are sharded (dp_shard * cp > 1)."""
        return self.fsdp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        """Sequences are split across ranks."""
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        """Experts are split across ranks."""
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        """The model is split into pipeline stages."""
        return self.pp > 1

    @property
    def hsdp(self) -> bool:
        """Hybrid sharding: replicated across dp_replicate, sharded within dp_shard."""
        return self.dp_replicate > 1 and self.fsdp_shard > 1
