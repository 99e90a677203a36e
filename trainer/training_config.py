"""The run's own sections: length, batch geometry and numerics (`[training]`) and periodic validation
(`[validation]`).

`trainer/train.py` reads both; they live here rather than there because train.py imports the composed
`JobConfig` (trainer/job_config.py), which imports every section.
"""

from dataclasses import dataclass

from core.config import option


@dataclass
class TrainingSection:
    """Length of the run, batch geometry and numerics."""

    steps: int = option(10, ge=1)
    """Number of optimizer steps to run."""
    local_batch_size: int = option(8, ge=1)
    """Sequences per microbatch on each data-parallel rank."""
    global_batch_size: int = option(-1, ge=1, special=-1)
    """Sequences per optimizer step over all ranks; -1 = local_batch_size * data-parallel degree. A larger
    multiple of that product turns the remainder into gradient accumulation."""
    seq_len: int = option(2048, ge=1)
    """Tokens per sequence."""
    max_norm: float = option(1.0, ge=0)
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    seed: int = 0
    """Random seed for weight init and data order."""
    deterministic: bool = False
    """Use deterministic algorithms (slower) so two runs with the same seed match bit for bit."""
    dtype: str = option("float32", choices=["float32", "bfloat16"])
    """Compute dtype of forward and backward; master weights always stay float32 (the AdamW moments' dtype is
    optimizer.state_dtype)."""
    mixed_precision_reduce: str = option("float32", choices=["float32", "bfloat16"])
    """Dtype in which data-parallel gradient reductions are done."""
    on_nonfinite: str = option("skip", choices=["skip", "stop"])
    """What a step with a NaN/Inf loss or grad norm does: skip (no optimizer update, one warning naming the step)
    or stop (the run ends with one line naming the step)."""


@dataclass
class ValidationSection:
    """Periodic evaluation on held-out data."""

    enable: bool = False
    """Run validation during training."""
    freq: int = option(10, ge=1)
    """Validate every this many steps."""
    steps: int = option(2, ge=1)
    """Batches per validation run."""
    dataset: str = ""
    """Dataset name or path; empty = the training dataset."""
    split: str = "validation"
    """Split of the validation dataset."""
    hold_out_every: int = option(25, ge=2)
    """Local files have no validation split: with dataset.path set, validation.dataset empty and validation.split
    "validation", validation reads every this many-th document of the training files and training skips them."""
