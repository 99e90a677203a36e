"""The `[checkpoint]` section: where checkpoints go, how often, what a run loads first, preemption signals."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError, option
from trainer.preemption import DEFAULT_SIGNALS, parse_signals


@dataclass
class CheckpointSection:
    """Saving and loading distributed checkpoints."""

    enable: bool = False
    """Save checkpoints and resume from the latest one found in folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = option(500, ge=1)
    """Save every this many steps."""
    keep_latest_k: int = option(0, ge=0)
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: str = option("disabled", choices=["disabled", "async"])
    """disabled saves synchronously; async writes in the background while training continues."""
    load_step: int = option(-1, ge=0, special=-1)
    """Step to resume from; -1 = the latest checkpoint in folder."""
    last_save_model_only: bool = False
    """Save only model weights (no optimizer or data state) at the last step, for export."""
    export_dtype: str = option("float32", choices=["float32", "bfloat16"])
    """Dtype of the weights in a model-only last save."""
    initial_load_path: str = ""
    """Checkpoint to initialise the model from when folder holds no checkpoint yet."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors checkpoint rather than a native one."""
    verify: str = option("size", choices=["off", "size", "checksum"])
    """How a resume checks a checkpoint before loading it. size: its DCP metadata is readable and every file is
    as long as the metadata says (stat only). checksum: also a CRC32 of every file, written at save by each rank
    for its own files and checked at load by the ranks in parallel (costs a read of the checkpoint at save and
    at load, docs/cluster.md). off: the metadata only. Whatever this says, a checkpoint that fails to load is
    skipped for the next older one."""
    allow_partial_load: bool = False
    """Load a checkpoint whose weights differ from the model's: weights the model does not have are skipped, and
    (initial_load_path only) weights the checkpoint lacks keep their initialisation; a warning names both. Off,
    either is an error before launch."""

    preemption_signals: list[str] = option(list(DEFAULT_SIGNALS))
    """Signals that end the run with a checkpoint of its last finished step, saved even when enable is false (see
    trainer/preemption.py); empty: none (the signals keep their default action)."""

    def check(self) -> list[ConfigError]:
        """Settings of this section that contradict each other, and unknown signal names."""
        if self.initial_load_in_hf and not self.initial_load_path:
            return [ConfigError("initial_load_in_hf", "true but checkpoint.initial_load_path is empty",
                                "a path to load from")]
        try:
            parse_signals(self.preemption_signals)
        except ValueError as e:
            return [ConfigError("preemption_signals", str(e), "signal names such as TERM, USR1, USR2, or empty")]
        return []
