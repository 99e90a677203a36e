"""Check a job before launching it: `python -m trainer.preflight --world-size N [config args]`.

`run_train.sh` calls this once before torchrun, so a bad config, tokenizer or dataset ends with one line and exit
code 2 instead of one torchrun failure report per rank. The trainer repeats the same checks in every rank.
With `job.print_config = true` it prints the merged config once the checks pass, and with
`parallelism.dry_run = true` the dry-run plan for the world size; both exit with NOTHING_TO_LAUNCH, which tells
`run_train.sh` not to launch anything. With `activation_checkpoint.mode = "budget"` it prints the choice per layer
(at the end of the printed config as comments).
"""

from __future__ import annotations

import dataclasses
import sys

from core.config import ConfigError, run_with_config_errors
from trainer.data.loader import GlobalOrderLoader, PackedDataLoader
from trainer.device import device_type
from trainer.tools.dry_run import print_report, report
from trainer.job_config import load_command_config
from trainer.tools.plan import DEFAULT_ROUTING_SKEW, Layout, evaluate
from trainer.tools.step_time import Hardware
from trainer.train import prepare

NOTHING_TO_LAUNCH = 10


def main(argv: list[str]) -> None:
    """Check the job of `argv` (`--world-size N` first, then config args) as a launch would."""
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    cfg = load_command_config(argv)
    prep = prepare(cfg, world_size, rank=0)
    if prep.auto_layout is not None:
        print(prep.auto_layout)
    cfg = prep.cfg
    for note in (fp8_speed_note(cfg, world_size, device_type()), data_loading_note(prep.train_loader)):
        if note is not None:
            print(note)
    if cfg.job.print_config:
        # the budget's lines as the config's closing comments: the output stays a config file
        print(prep.config_text(), end="")
        sys.exit(NOTHING_TO_LAUNCH)
    if prep.ac_budget is not None:
        print("\n".join(prep.ac_budget))
    if cfg.parallelism.dry_run:
        print_report(report(cfg, world_size), world_size, cfg)
        sys.exit(NOTHING_TO_LAUNCH)


TOKENIZING_NOTE_TOKENS = 1 << 20
"""Tokens per global batch from which preflight suggests pre-tokenized data: tokenizing as it reads, every rank
tokenizes the whole batch, about 0.4-0.5 s a step at the 2.0-2.6 M tokens/s of one CPU core (docs/data.md)."""


def data_loading_note(loader: GlobalOrderLoader) -> str | None:
    """One line when the training loader tokenizes as it reads and a global batch holds at least
    `TOKENIZING_NOTE_TOKENS` tokens, saying how many and how to read pre-tokenized data instead; None otherwise."""
    if not isinstance(loader, PackedDataLoader):
        return None
    tokens = loader.global_batch_size * (loader.seq_len + 1)
    if tokens < TOKENIZING_NOTE_TOKENS:
        return None
    return (f"data: every rank tokenizes the whole global batch, {tokens:,} tokens a step ({loader.global_batch_size} "
            f"sequences of {loader.seq_len + 1}), whatever the data-parallel degree; tokenize once (.venv/bin/python "
            "-m trainer.pretokenize [this job's config args] --output DIR) and train with --dataset.pretokenized DIR, "
            "so that each rank reads only its own sequences (docs/data.md#pre-tokenized-data)")


def fp8_speed_note(cfg, world_size: int, device: str) -> str | None:
    """One line when the step-time model (`trainer.tools.step_time`) predicts the config's FP8 recipe slower than
    bf16 on the config's own layout, with what its quantisation costs, what its GEMMs save, and from how many more
    tokens per GEMM it would pay (the saving and the activations' quantisation grow with the tokens, the weights'
    does not); None otherwise. CUDA launches only: the model is of a GPU, and on CPU every FP8 GEMM is emulated."""
    if cfg.fp8.recipe == "none" or device != "cuda":
        return None
    own, cache = Layout.of_config(cfg, world_size), {}
    try:
        fp8, bf16 = (evaluate(cfg, layout, world_size, device, DEFAULT_ROUTING_SKEW, Hardware(), cache)
                     ["step_breakdown_s"] for layout in (own, dataclasses.replace(own, fp8="none")))
    except ConfigError:  # a model without a memory plan: nothing to predict with
        return None
    ratio = bf16["step_s"] / fp8["step_s"]
    if ratio >= 1:
        return None
    quantize, saved, weights = fp8["fp8_quantize_s"], fp8["fp8_saved_s"], fp8["fp8_quantize_weights_s"]
    if saved > quantize - weights:
        pays = (f"FP8 pays from about {weights / (saved - quantize + weights):.1f}x these tokens per GEMM (a larger "
                "batch, or wider layers)")
    else:
        pays = "at these layer widths FP8 does not pay at any batch (quantising the activations costs more than " \
               "the GEMMs save)"
    return (f"fp8.recipe = {cfg.fp8.recipe}: predicted {ratio:.2f}x bf16 tokens/s at these shapes (quantisation "
            f"{quantize * 1e3:.1f} ms vs GEMM savings {saved * 1e3:.1f} ms per step; step-time model calibrated on "
            f"one H200 run; .venv/bin/python -m trainer.plan --hw.<input> tries others); "
            f"{pays}")


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
