"""The job's loaders: which `[dataset]` section the training and the validation loader read, each built and its
first document read before launch (or its pre-tokenized split opened and checked against the job), and the job's
config key behind a DatasetError (`dataset.*` or `validation.*`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from core.config import ConfigError
from trainer.data.config import DatasetError
from trainer.data.loader import GlobalOrderLoader, build_dataloader
from trainer.data.pretokenized import (PretokenizedLoader, PretokenizedSplitError, open_split, read_meta,
                                       tokenizer_identity)
from trainer.data.sources import has_documents
from trainer.job_config import JobConfig
from trainer.tokenizer import resolve_path


def holds_out(cfg: JobConfig) -> bool:
    """Whether validation reads a held-out part of the training files: local files have no "validation" split."""
    return bool(cfg.dataset.path) and not cfg.validation.dataset and cfg.validation.split == "validation"


def hold_out_every(cfg: JobConfig) -> int:
    """Every how many training documents one goes to validation (`holds_out`), or 0: none is held out."""
    return cfg.validation.hold_out_every if cfg.validation.enable and holds_out(cfg) else 0


def validation_dataset(cfg: JobConfig):
    """The [dataset] section validation reads: the training files when they hold out a part (`holds_out`), another
    dataset named by validation.dataset, or the training dataset's validation split."""
    if holds_out(cfg):
        return cfg.dataset
    ds = dataclasses.replace(cfg.dataset, split=cfg.validation.split)
    if cfg.validation.dataset:
        if os.path.exists(cfg.validation.dataset):
            # Local files form the one split "train": the default split name stands for the whole file.
            split = "train" if cfg.validation.split == "validation" else cfg.validation.split
            ds = dataclasses.replace(ds, path=cfg.validation.dataset, split=split)
        else:
            ds = dataclasses.replace(ds, name=cfg.validation.dataset, path="")
    return ds


def data_key(cfg: JobConfig, key: str, validation: bool) -> str:
    """The config key behind a DatasetError's dataset attribute, for the training or the validation loader."""
    if validation and key == "split" and not holds_out(cfg):
        return "validation.split"
    if validation and key in ("name", "path") and cfg.validation.dataset:
        return "validation.dataset"
    return f"dataset.{key}"


def documents_origin(cfg: JobConfig, hold_out: int, validation: bool) -> dict:
    """The settings that choose the training or the validation documents, as a pre-tokenized folder records them.

    Taken from the keys as set, not from the files: a run from the folder may not have the documents at hand (a
    local `validation.dataset` that is missing would otherwise count as a Hugging Face name)."""
    ds = cfg.dataset
    dataset, split = (_source(ds.path) if ds.path else ds.name), ds.split or "train"
    if validation:
        dataset = _source(cfg.validation.dataset) if cfg.validation.dataset else dataset
        split = cfg.validation.split
    return {"dataset": dataset, "split": split, "text_field": ds.text_field, "hold_out_every": hold_out,
            "held_out": bool(hold_out) and validation}


def _source(name_or_path: str) -> str:
    """A dataset path as an absolute path (where it exists, or was given absolute), else the name as given."""
    resolved = resolve_path(name_or_path)
    return os.path.abspath(resolved) if resolved.exists() or resolved.is_absolute() else name_or_path


def build_loader(cfg: JobConfig, loader_args: dict, hold_out: int, validation: bool) -> GlobalOrderLoader:
    """The training or validation loader, its first document read so that a wrong text field, an unknown dataset
    or an empty split fails before launch; a DatasetError becomes a ConfigError naming the key at fault. With
    `dataset.pretokenized`, the folder's split, checked against this job's tokenizer and documents."""
    if cfg.dataset.pretokenized:
        return _pretokenized_loader(cfg, loader_args, hold_out, validation)
    ds = validation_dataset(cfg) if validation else cfg.dataset
    try:
        loader = build_dataloader(ds, **loader_args, hold_out_every=hold_out, held_out=validation)
        if has_documents(loader.source):
            return loader
    except DatasetError as e:
        allowed = e.allowed
        if validation:
            allowed = ", ".join(filter(None, [allowed, "a validation.dataset, or validation.enable = false"]))
        raise ConfigError(data_key(cfg, e.key, validation), e.problem, allowed)
    problem = f"{loader.source.description}: no documents"
    if validation and hold_out:
        raise ConfigError("validation.hold_out_every", f"{problem} (the files hold fewer than {hold_out})",
                          "at most the number of documents, a validation.dataset, or validation.enable = false")
    raise ConfigError(data_key(cfg, "path" if ds.path else "name", validation), problem)


def _pretokenized_loader(cfg: JobConfig, loader_args: dict, hold_out: int, validation: bool) -> PretokenizedLoader:
    args = dict(loader_args)
    tokenizer = tokenizer_identity(cfg.tokenizer.path, args.pop("tokenizer"))
    folder = resolve_path(cfg.dataset.pretokenized)
    try:
        stream = open_split(folder, read_meta(folder), "validation" if validation else "train",
                            documents_origin(cfg, hold_out, validation), tokenizer)
    except PretokenizedSplitError as e:
        config = f"--job.config_file {cfg.job.config_file} " if cfg.job.config_file else ""
        raise ConfigError("dataset.pretokenized", str(e), f"a folder written for this job (`python -m "
                          f"trainer.pretokenize {config}[overrides] --force`), or \"\" to tokenize as training reads")
    return PretokenizedLoader(stream, **args)


@contextlib.contextmanager
def data_errors_at(cfg: JobConfig, step: int, rank: int, validation: bool):
    """Mark a DatasetError raised inside with the step, the rank and the config key at fault, for its one line."""
    try:
        yield
    except DatasetError as e:
        e.where = f"step {step}, rank {rank}{', validation' if validation else ''}"
        e.config_key = data_key(cfg, e.key, validation)
        raise
