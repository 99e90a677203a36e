"""`python -m trainer.memory_plan`: the memory plan (the code is in `trainer/tools/memory_plan.py`)."""

from trainer.tools.memory_plan import cli

if __name__ == "__main__":
    cli()
