"""Parallel degrees resolved against the world size, checked once before any mesh or model is built.

The world is `pp * dp_replicate * dp_shard` ranks. Expert parallelism does not add a factor: EP borrows ranks
from the data-parallel shard dimension ("dp2ep"), so `dp_shard = efsdp * ep` where `efsdp` is the FSDP degree
left over for the expert weights.
"""

from dataclasses import dataclass

from trainer.config import ConfigError, ParallelismSection


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees. Construction checks that they tile the world; use `from_config`."""

    dp_replicate: int
    """Data-parallel replicas (HSDP replicate dimension)."""
    dp_shard: int
    """FSDP shard degree of dense weights (resolved, never -1)."""
    ep: int
    """Expert-parallel degree, carved out of dp_shard."""
    pp: int
    """Pipeline-parallel degree."""
    world_size: int
    """Total number of ranks."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError("world_size", f"{self.world_size} is not a positive number of ranks", ">= 1")
        for key, value in (
            ("parallelism.data_parallel_replicate_degree", self.dp_replicate),
            ("parallelism.data_parallel_shard_degree", self.dp_shard),
            ("parallelism.expert_parallel_degree", self.ep),
            ("parallelism.pipeline_parallel_degree", self.pp),
        ):
            if value < 1:
                raise ConfigError(key, f"{value} is out of range", ">= 1")
        product = self.dp_replicate * self.dp_shard * self.pp
        if product != self.world_size:
            raise ConfigError(
                "parallelism",
                f"data_parallel_replicate_degree ({self.dp_replicate}) * data_parallel_shard_degree "
                f"({self.dp_shard}) * pipeline_parallel_degree ({self.pp}) = {product}, "
                f"but the world size is {self.world_size}",
                f"degrees whose product is {self.world_size}, or data_parallel_shard_degree = -1 to fill the rest",
            )
        if self.dp_shard % self.ep:
            raise ConfigError(
                "parallelism.expert_parallel_degree",
                f"{self.ep} does not divide data_parallel_shard_degree ({self.dp_shard}); EP borrows ranks from "
                "the data-parallel shard dimension, it is not an extra factor of the world size",
                _divisors(self.dp_shard),
            )

    @classmethod
    def from_config(cls, parallelism_cfg: ParallelismSection, world_size: int) -> "ParallelDims":
        """Resolve `data_parallel_shard_degree = -1` to the ranks left over and check the degrees."""
        dp_replicate = parallelism_cfg.data_parallel_replicate_degree
        pp = parallelism_cfg.pipeline_parallel_degree
        dp_shard = parallelism_cfg.data_parallel_shard_degree
        if dp_shard == -1:
            rest = dp_replicate * pp
            if rest < 1 or world_size % rest:
                raise ConfigError(
                    "parallelism.data_parallel_shard_degree",
                    f"-1 cannot fill the world: world size {world_size} is not divisible by "
                    f"data_parallel_replicate_degree ({dp_replicate}) * pipeline_parallel_degree ({pp}) = {rest}",
                    f"data_parallel_replicate_degree * pipeline_parallel_degree among {_divisors(world_size)}",
                )
            dp_shard = world_size // rest
        return cls(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=parallelism_cfg.expert_parallel_degree,
            pp=pp,
            world_size=world_size,
        )

    @property
    def dp(self) -> int:
        """Total data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """FSDP degree of the expert weights: the shard ranks not used for expert parallelism."""
        return self.dp_shard // self.ep

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel rank."""
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Dense weights are sharded (dp_shard > 1)."""
        return self.dp_shard > 1

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
        return self.dp_replicate > 1 and self.dp_shard > 1
