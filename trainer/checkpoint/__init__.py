"""Distributed checkpoints (torch.distributed.checkpoint): save, resume, reshard, model-only export.

Layout: `<dump_folder>/<checkpoint.folder>/step-<N>/` holds one DCP checkpoint with
    model        every model part's state dict, under the full model's parameter names (expert bias included)
    optimizer    every part's AdamW state, flattened and keyed by parameter name (so any layout can load it)
    lr_scheduler (the schedule's position; on resume the LR comes from the current config: a run extended to more
                 steps follows its new schedule), dataloader (global stream position), train_state (step, RNG)
Names do not depend on the parallel layout, so a checkpoint saved at (fsdp=2, ep=2) loads at fsdp=4, on one
process, or split into pipeline stages: DCP reshards.

Atomicity: a checkpoint is written to `step-<N>.tmp` and renamed to `step-<N>` by rank 0 after every rank has
finished writing. Resume only considers `step-<N>` folders with DCP metadata, so a crash mid-save (even a killed
rank) leaves the previous checkpoint as the latest.

The package, one concern per module:

    config.py   the [checkpoint] section and its checks
    files.py    the checkpoints on disk: the complete ones, damage (a shard missing or cut short against the DCP
                metadata), the one a run resumes from; CheckpointError, the preemption marker
    weights.py  what a checkpoint holds against the model: WeightMismatch (missing, extra, reshaped weights), the
                refusal or the note of a partial load, check_checkpoint
    states.py   the Stateful views DCP saves and loads: model, optimizer, LR schedules and loader, train state, and
                a partial load's view of the model
    manager.py  CheckpointManager: resume, save (sync, async, on preemption), publish, purge; CheckpointSaveError
"""
