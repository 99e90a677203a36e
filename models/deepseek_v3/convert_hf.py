"""Convert between Hugging Face DeepSeek checkpoints and the trainer's DCP checkpoints (single process).

    python -m models.deepseek_v3.convert_hf to_dcp <hf_dir> <out_dcp_dir> [--num-mtp-layers N]
    python -m models.deepseek_v3.convert_hf from_dcp <dcp_dir> <out_hf_dir> (--flavor X | --hf-config PATH)
        [--dtype float32|bfloat16] [--max-shard-mb N]

A trainer checkpoint is a torch.distributed.checkpoint directory whose state dict holds the model under "model"
with our FQNs (optimizer or data state next to it is ignored here). Both directions stream: `to_dcp` reads one HF
shard at a time into the tensors it then saves, `from_dcp` loads the model tensors once and writes HF shards one
at a time. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .args import FLAVORS, ModelArgs
from .hf import (
    args_from_hf_config_file,
    check_exportable_bias,
    detect_mtp_layers,
    expected_shapes,
    exported_bias_fqns,
    hf_config_from_args,
    read_hf_state_dict,
    save_hf_checkpoint,
)

MODEL_KEY = "model"  # the trainer's state dict keeps the model's FQNs under this key


@contextmanager
def _single_process():
    """DCP warns that it assumes one process even when asked for exactly that (no_dist=True): silence only that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def hf_to_dcp(hf_dir: str | Path, out_dir: str | Path, num_mtp_layers: int | None = None,
              progress: bool = True) -> ModelArgs:
    """Write the HF checkpoint at hf_dir as a trainer DCP checkpoint (fp32) and return its model args.

    num_mtp_layers None keeps the MTP layers the checkpoint stores (up to `num_nextn_predict_layers`).
    """
    args = args_from_hf_config_file(hf_dir)
    mtp = detect_mtp_layers(hf_dir, args) if num_mtp_layers is None else num_mtp_layers
    args = args.replace(num_mtp_layers=mtp)
    state = read_hf_state_dict(hf_dir, args, dtype=torch.float32, progress=progress)
    with _single_process():
        dcp.save({MODEL_KEY: state}, checkpoint_id=str(out_dir), no_dist=True)
    return args


def _dcp_model_shapes(dcp_dir: Path) -> dict[str, torch.Size]:
    """FQN -> shape of the model tensors stored in a DCP checkpoint (from its metadata only)."""
    if not (dcp_dir / ".metadata").is_file():
        raise ValueError(f"not a DCP checkpoint (no .metadata): {dcp_dir}")
    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata()
    prefix = MODEL_KEY + "."
    return {key[len(prefix):]: meta.size for key, meta in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(meta, "size")}


def dcp_to_hf(dcp_dir: str | Path, out_dir: str | Path, args: ModelArgs, dtype: str = "float32",
              max_shard_bytes: int = 4 * 2**30, progress: bool = True) -> Path:
    """Write the model of a trainer DCP checkpoint as a HF checkpoint directory.

    `args` describes the architecture (flavor or HF config); the number of MTP layers is read from the checkpoint.
    Every tensor the args need must be stored with the same shape, else ValueError naming it.
    """
    stored = _dcp_model_shapes(Path(dcp_dir))
    mtp_ids = {int(m.group(1)) for fqn in stored if (m := re.match(r"mtp\.layers\.(\d+)\.", fqn))}
    args = args.replace(num_mtp_layers=len(mtp_ids))
    expected = expected_shapes(args)
    for fqn, shape in expected.items():
        if fqn not in stored:
            raise ValueError(f"DCP checkpoint {dcp_dir} has no model tensor {fqn} (wrong flavor or config?)")
        if stored[fqn] != shape:
            raise ValueError(f"{fqn}: shape {list(stored[fqn])} in the DCP checkpoint, expected {list(shape)} "
                             "(wrong flavor or config?)")
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise ValueError(f"DCP checkpoint {dcp_dir} has model tensor {extra[0]} these args do not have "
                         "(wrong flavor or config?)")
    # Preflight: what HF cannot express fails before the weights are read or anything is written. The expert
    # biases are a few floats per layer, read on their own first.
    hf_config_from_args(args, dtype)
    biases = {fqn: torch.empty(expected[fqn]) for fqn in exported_bias_fqns(args)}
    if biases:
        with _single_process():
            dcp.load({MODEL_KEY: biases}, checkpoint_id=str(dcp_dir), no_dist=True)
        check_exportable_bias(biases, args)
    state = {fqn: torch.empty(shape) for fqn, shape in expected.items()}
    # DCP reads into these tensors in place (and converts from the stored dtype)
    with _single_process():
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(dcp_dir), no_dist=True)
    return save_hf_checkpoint(state, args, out_dir, max_shard_bytes=max_shard_bytes, dtype=dtype,
                              progress=progress)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.deepseek_v3.convert_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to_dcp", help="HF checkpoint directory -> trainer DCP checkpoint")
    to.add_argument("hf_dir")
    to.add_argument("out_dir")
    to.add_argument("--num-mtp-layers", type=int, default=None,
                    help="MTP layers to import (default: those the checkpoint stores)")
    frm = sub.add_parser("from_dcp", help="trainer DCP checkpoint -> HF checkpoint directory")
    frm.add_argument("dcp_dir")
    frm.add_argument("out_dir")
    arch = frm.add_mutually_exclusive_group(required=True)
    arch.add_argument("--flavor", choices=sorted(FLAVORS))
    arch.add_argument("--hf-config", help="config.json (or a directory holding it) describing the model")
    frm.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    frm.add_argument("--max-shard-mb", type=int, default=4096, help="largest shard file size in MiB")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0, or 2 after printing a one-line error)."""
    opts = _parser().parse_args(argv)
    try:
        if opts.command == "to_dcp":
            args = hf_to_dcp(opts.hf_dir, opts.out_dir, opts.num_mtp_layers)
            print(f"wrote DCP checkpoint {opts.out_dir} ({args.n_layers} layers, {args.num_mtp_layers} MTP)")
        else:
            args = FLAVORS[opts.flavor] if opts.flavor else args_from_hf_config_file(opts.hf_config)
            out = dcp_to_hf(opts.dcp_dir, opts.out_dir, args, dtype=opts.dtype,
                            max_shard_bytes=opts.max_shard_mb * 2**20)
            print(f"wrote HF checkpoint {out}")
    except ValueError as e:
        print(f"convert_hf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
