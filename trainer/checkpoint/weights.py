"""What a checkpoint holds against the model: the weights they do not share by name or by shape, whether a load
may go on (a resume needs every weight, an initial load with allow_partial_load takes what matches), and the
weights a partial load reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed.checkpoint as dcp

from trainer.checkpoint.files import CheckpointError, checkpoint_damage


def key_groups(keys: list[str], limit: int = 4) -> str:
    """Keys summarised by module, cut after their first numeric component: `layers.4.*, layers.5.* (36 weights)`."""
    groups: dict[str, None] = {}
    for key in keys:
        parts = key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        groups[key if cut is None or cut == len(parts) - 1 else ".".join(parts[:cut + 1]) + ".*"] = None
    names = list(groups)
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return f"{shown} ({len(keys)} weight{'s' if len(keys) != 1 else ''})"


def key_names(keys: list[str], limit: int = 3) -> str:
    """The first `limit` keys in full, then a count: `a, b, c and 17 more (20 weights)`."""
    shown = ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
    return f"{shown} ({len(keys)} weight{'s' if len(keys) != 1 else ''})"


_RESUME_NEEDS_ALL = ("; a resume needs every weight: start a new run from it with checkpoint.initial_load_path and "
                     "checkpoint.allow_partial_load = true")


@dataclass
class WeightMismatch:
    """The weights a checkpoint and a model do not share (names as the checkpoint spells them).

    missing: the model expects them, the checkpoint lacks them; `missing_ours` has them under the model's
        state_dict keys (for the hint of `optional_weights`). extra: the checkpoint holds them, the model has no
        place for them. reshaped: both have them, in other shapes (another flavor's experts): name -> (the
        checkpoint's shape, the model's).
    """

    path: str
    missing: list[str]
    missing_ours: list[str]
    extra: list[str]
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    def problem(self, optional_weights: dict[str, str], allow_partial: bool, resume: bool) -> str | None:
        """The one-line reason the checkpoint cannot be loaded, or None. A resume needs every weight of the model
        as the model has it; an initial load with `allow_partial` takes what matches."""
        if self.missing and (resume or not allow_partial):
            line = f"checkpoint {self.path} lacks {key_groups(self.missing)} that the model expects"
            switches = {switch for prefix, switch in optional_weights.items()
                        if all(k.startswith(prefix) for k in self.missing_ours)}
            if switches:
                line += f"; train without them: {' '.join(sorted(switches))}"
            elif resume:
                line += _RESUME_NEEDS_ALL
            else:
                line += "; checkpoint.allow_partial_load = true keeps their initialisation"
            return line
        if self.reshaped and (resume or not allow_partial):
            name, (saved, wanted) = next(iter(self.reshaped.items()))
            line = (f"checkpoint {self.path} holds {key_names(list(self.reshaped))} in other shapes than the model's "
                    f"({name}: {list(saved)} saved, {list(wanted)} in the model): saved from another flavor or "
                    "other model settings?")
            return line + (_RESUME_NEEDS_ALL if resume else
                           "; checkpoint.allow_partial_load = true loads the weights that match and skips these")
        if self.extra and not allow_partial:
            return (f"checkpoint {self.path} holds {key_groups(self.extra)} that the model does not have (a deeper "
                    "model, another flavor, or a part this run leaves out?); checkpoint.allow_partial_load = true "
                    "loads the rest")
        return None

    def note(self) -> str | None:
        """The warning of a partial load: what is skipped and what keeps its initialisation; None if nothing."""
        parts = []
        if self.extra:
            parts.append(f"skipped {key_groups(self.extra)} the model does not have")
        if self.reshaped:
            parts.append(f"skipped {key_names(list(self.reshaped))} in other shapes than the model's (they keep "
                         "their initialisation)")
        if self.missing:
            parts.append(f"{key_groups(self.missing)} the checkpoint lacks keep their initialisation")
        return f"partial load of {self.path}: " + "; ".join(parts) if parts else None

    def loadable(self, expected_shapes: dict[str, tuple[int, ...]]) -> set[str]:
        """The model's keys a partial load reads: in the checkpoint, in the model's shape (native checkpoints,
        whose names are the model's)."""
        return set(expected_shapes) - set(self.missing) - set(self.reshaped)


def check_checkpoint(path: str, expected_shapes: dict[str, tuple[int, ...]],
                     model_only: bool = False) -> WeightMismatch:
    """Raise CheckpointError unless `path` is a complete, readable DCP checkpoint (with optimizer state unless
    `model_only`); return the weights it and a model of `expected_shapes` do not share by name or by shape (the
    caller decides).

    Reads only metadata and file sizes, so the trainer can run it before any process group exists: a corrupt or
    truncated checkpoint, or one from another flavor, is reported as one line before anything starts.
    """
    damage = checkpoint_damage(path)
    if damage is not None:
        raise CheckpointError(damage)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weights = {key[len("model."):]: entry for key, entry in saved.items() if key.startswith("model.")}
    if not model_only and not any(key.startswith("optimizer.") for key in saved):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (a model-only export cannot be resumed)")
    reshaped = {}
    for fqn, shape in expected_shapes.items():
        entry = weights.get(fqn)
        if entry is not None and tuple(getattr(entry, "size", ())) != tuple(shape):
            reshaped[fqn] = (tuple(entry.size), tuple(shape))
    missing = [fqn for fqn in expected_shapes if fqn not in weights]
    return WeightMismatch(path, missing, missing, [fqn for fqn in weights if fqn not in expected_shapes], reshaped)
