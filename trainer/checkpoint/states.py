"""The Stateful views DCP saves and loads: names that do not depend on the parallel layout, so DCP reshards."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.optimizer import MOMENTS


class ModelState(Stateful):
    """All model parts as one state dict with the full model's names."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self):
        merged = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict):
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OnlySaved(Stateful):
    """A partial load's view of the model state: only the weights the checkpoint holds in the model's shapes are
    asked for (DCP refuses to load a key it lacks or a tensor of another shape); the others keep their
    initialisation."""

    def __init__(self, model: ModelState, saved: set[str]):
        self.model, self.saved = model, saved

    def state_dict(self):
        return {k: v for k, v in self.model.state_dict().items() if k in self.saved}

    def load_state_dict(self, state_dict):
        self.model.load_state_dict(state_dict)


_RUN_KEYS = ("lr", "foreach", "fused", "capturable", "differentiable")
"""Param-group keys a resume keeps from this run's optimizer, not from the checkpoint."""


class OptimizerState(Stateful):
    """One optimizer per model part, flattened to parameter-name keys and merged."""

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        merged = {}
        for part, opt in zip(self.parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=self.options))
        return merged

    def load_state_dict(self, state_dict):
        for part, opt in zip(self.parts, self.optimizers):
            # The LR belongs to the LR schedule, which recomputes it from the current config on resume; the saved
            # one is the old schedule's (DCP loads the schedule first: keys load in sorted order). The kernel flags
            # belong to this run's optimizer.implementation and state_dtype: torch's load would take the saved
            # groups' (a checkpoint of foreach or of bf16 moments would turn a fused AdamW's step into another).
            kept = [{key: group[key] for key in _RUN_KEYS if key in group} for group in opt.param_groups]
            set_optimizer_state_dict(part, opt, state_dict, options=self.options)
            for group, own in zip(opt.param_groups, kept, strict=True):
                group.update(own)

    def conversion_note(self, path: str) -> str | None:
        """One line if the checkpoint at `path` holds the AdamW moments in another dtype than these optimizers
        (`optimizer.state_dtype` changed since it was saved), else None. DCP's load copies into the existing state
        tensors, which converts; this reads the checkpoint's metadata to say so."""
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        saved = {md.properties.dtype for key, md in metadata.items()
                 if key.rsplit(".", 1)[-1] in MOMENTS and isinstance(md, TensorStorageMetadata)}
        ours = {state[key].dtype for opt in self.optimizers for state in opt.state.values()
                for key in MOMENTS if key in state}
        if not saved or not ours or saved == ours:
            return None

        def names(dtypes):
            return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))

        return (f"optimizer state converted on load: the checkpoint's AdamW moments are {names(saved)}, this run "
                f"keeps them in {names(ours)} (optimizer.state_dtype)")


class ObjectState(Stateful):
    """Objects with state_dict/load_state_dict (LR schedulers, the data loader), replicated on every rank.

    Their states are stored as one opaque pickled blob each: DCP loads nested lists element-wise into the
    *current* structure, so a list whose length changed since construction (the loader's token carry-over)
    would silently come back empty.
    """

    def __init__(self, *objects):
        self.objects = objects

    def state_dict(self):
        return {str(i): pickle.dumps(obj.state_dict()) for i, obj in enumerate(self.objects)}

    def load_state_dict(self, state_dict):
        for i, obj in enumerate(self.objects):
            obj.load_state_dict(pickle.loads(state_dict[str(i)]))


class TrainState(Stateful):
    """The step counter and the CPU RNG state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])
