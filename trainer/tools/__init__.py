"""The command-line tools around the loop, each run as `python -m trainer.<tool>` (a two-line entry module in
trainer/ keeps those commands as documented):

    preflight     the checks of a launch, once, before torchrun starts (run_train.sh)
    dry_run       what every pipeline stage's rank would hold for any world size, on a fake process group
    memory_plan   the predicted per-rank peak of a layout, from the dry run and the model's memory description
    plot_memory   a run's memory curves from its tensorboard files, with the leak detector's verdicts
"""
