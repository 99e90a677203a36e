"""`python -m trainer.dry_run`: the dry run (the code is in `trainer/tools/dry_run.py`)."""

from trainer.tools.dry_run import cli

if __name__ == "__main__":
    cli()
