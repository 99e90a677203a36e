"""`python -m trainer.plot_memory`: a run's memory curves (the code is in `trainer/tools/plot_memory.py`)."""

from trainer.tools.plot_memory import cli

if __name__ == "__main__":
    cli()
