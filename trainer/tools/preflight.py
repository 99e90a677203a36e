"""Check a job before launching it: `python -m trainer.preflight --world-size N [config args]`.

`run_train.sh` calls this once before torchrun, so a bad config, tokenizer or dataset ends with one line and exit
code 2 instead of one torchrun failure report per rank. The trainer repeats the same checks in every rank.
With `job.print_config = true` it prints the merged config once the checks pass, and with
`parallelism.dry_run = true` the dry-run plan for the world size; both exit with NOTHING_TO_LAUNCH, which tells
`run_train.sh` not to launch anything.
"""

from __future__ import annotations

import sys

from core.config import config_to_toml, run_with_config_errors
from trainer.tools.dry_run import print_report, report
from trainer.job_config import load_command_config
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
    if cfg.job.print_config:
        print(config_to_toml(cfg), end="")
        sys.exit(NOTHING_TO_LAUNCH)
    if cfg.parallelism.dry_run:
        print_report(report(cfg, world_size), world_size, cfg)
        sys.exit(NOTHING_TO_LAUNCH)


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
