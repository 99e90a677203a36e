"""The config sections a model family reads: which model to build (`[model]`) and the MoE training knobs (`[moe]`).

They live here, below the trainer that composes them into the job config and the model families that read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import option

__all__ = ["ModelSection", "MoESection"]


@dataclass
class ModelSection:
    """Which model to build."""

    name: str = "deepseek_v3"
    """Model family, looked up in the model registry."""
    flavor: str = "debugmodel"
    """Named size preset of the model family (e.g. debugmodel, 16B, 671B)."""
    hf_config_path: str = ""
    """Optional Hugging Face config.json; when set, model args come from it instead of the flavor."""
    n_layers: int = option(0, ge=1, special=0)
    """Number of transformer layers, overriding the flavor's (or the HF config's); 0 = keep it. Cuts a flavor
    to a benchmarkable size with its real layer shapes (train_configs/h100_bench.toml: 16B with 4 layers)."""
    n_dense_layers: int = option(-1, ge=0, special=-1)
    """How many of the first layers use a dense FFN instead of MoE, overriding the flavor's; -1 = keep it. At
    most n_layers."""
    max_seq_len: int = option(0, ge=1, special=0)
    """Longest sequence the model's position encoding covers, overriding the flavor's (or the HF config's); 0 =
    keep it. Past the context the model was pre-trained on, its RoPE is stretched with YaRN (DeepSeek-V3: 4096
    tokens x rope_factor 40 = 163840), as for long-context fine-tuning."""
    mtp_layers: int = option(-1, ge=0, special=-1)
    """Multi-token-prediction layers: -1 = as the flavor (or the HF config's num_nextn_predict_layers) says, 0 =
    none, N = that depth. A checkpoint saved by transformers declares MTP in config.json but stores no MTP weights:
    train from it with 0."""


@dataclass
class MoESection:
    """Mixture-of-experts training knobs."""

    load_balance_coeff: float = option(1e-3, ge=0)
    """Step size of the aux-loss-free expert-bias update; 0 disables the update."""
    aux_loss_coeff: float = option(0.0, ge=0)
    """Weight of the DeepSeek-V3 sequence-wise balance loss; 0 disables it."""
    use_grouped_mm: bool = True
    """Run the routed experts as one grouped matmul instead of a loop over experts."""
