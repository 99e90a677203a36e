"""`python -m trainer.preflight`: the checks before a launch (the code is in `trainer/tools/preflight.py`)."""

from trainer.tools.preflight import cli

if __name__ == "__main__":
    cli()
