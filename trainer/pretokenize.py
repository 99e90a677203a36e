"""`python -m trainer.pretokenize`: a job's documents tokenized once (the code is in `trainer/tools/pretokenize.py`)."""

from trainer.tools.pretokenize import cli

if __name__ == "__main__":
    cli()
