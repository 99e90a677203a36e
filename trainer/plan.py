"""`python -m trainer.plan`: the layout planner (the code is in `trainer/tools/plan.py`)."""

from trainer.tools.plan import cli

if __name__ == "__main__":
    cli()
