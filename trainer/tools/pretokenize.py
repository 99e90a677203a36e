"""Tokenize a job's documents once: `python -m trainer.pretokenize [--job.config_file F] [overrides] [--output DIR]
[--workers N] [--force]`.

It reads the documents the job's training loader reads (and its validation loader's, when validation is on): the
same `[dataset]`, `[validation]` and `[tokenizer]` keys, the same held-out part of local files. It writes each
document's `[BOS] + tokens + [EOS]` in the global order into a folder (`trainer/data/pretokenized.py` has the
format), by default the one the config's `dataset.pretokenized` names. A run with `dataset.pretokenized` set to
that folder trains on exactly the batches it would tokenize itself, but each rank reads only its own sequences
(docs/data.md). The stream does not depend on `training.seq_len` or the batch: one folder serves them all.

`--workers` processes tokenize (default: the CPU count); the output is the same for any number. The folder appears
only when complete: an error or an interrupt leaves nothing behind, and `--force` replaces only a folder this command
wrote. A config, dataset or output mistake ends with one line and exit code 2, most of them before any tokenizing. Prints a JSON summary: documents, tokens and bytes per split, seconds, tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from core.config import ConfigError, check_fields, check_sections, run_with_config_errors
from trainer.data.config import DatasetError
from trainer.data.for_job import build_loader, data_key, documents_origin, hold_out_every
from trainer.data.pretokenized import META, tokenizer_identity, write_folder
from trainer.data.sources import DocumentSource
from trainer.job_config import load_command_config
from trainer.prepare import job_tokenizer
from trainer.tokenizer import Tokenizer, build_tokenizer

_BATCH = 4096
"""Documents handed to the workers at a time."""
_PROGRESS_S = 10.0

_worker_tokenizer: Tokenizer | None = None


def _start_worker(path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(path)


def _encode(text: str, tokenizer: Tokenizer | None = None) -> np.ndarray:
    return np.asarray((tokenizer or _worker_tokenizer).encode(text, bos=True, eos=True), dtype=np.uint32)


class _Split:
    """One split's documents, tokenized in order (on `pool`'s `workers` processes when there is one), with a
    progress line on stderr; a document that cannot be read ends it with a ConfigError naming the job's key."""

    def __init__(self, cfg, name: str, source: DocumentSource, tokenizer: Tokenizer, pool, workers: int) -> None:
        self.cfg, self.name, self.source, self.tokenizer, self.pool, self.workers = (cfg, name, source, tokenizer,
                                                                                   pool, workers)
        self.documents = self.tokens = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        try:
            yield from self._encoded()
        except DatasetError as e:
            raise ConfigError(data_key(self.cfg, e.key, self.name == "validation"), e.problem, e.allowed) from None

    def _encoded(self) -> Iterator[np.ndarray]:
        start = last = time.perf_counter()
        texts = self.source.iter_texts(0)
        while batch := list(itertools.islice(texts, _BATCH)):
            if self.pool is None:
                encoded = [_encode(text, self.tokenizer) for text in batch]
            else:
                encoded = self.pool.map(_encode, batch, chunksize=max(1, len(batch) // (4 * self.workers)))
            for ids in encoded:
                self.documents += 1
                self.tokens += len(ids)
                yield ids
            if time.perf_counter() - last > _PROGRESS_S:
                last = time.perf_counter()
                print(f"pretokenize: {self.name}: {self.documents} documents, {self.tokens} tokens, "
                      f"{self.tokens / (last - start):,.0f} tokens/s", file=sys.stderr, flush=True)


def _output_folder(path: str, force: bool) -> Path:
    """The folder to write, refused before any tokenizing when it cannot be: none named, a file or a link, an existing
    folder without --force, one this command did not write (--force replaces only those), no writable parent."""
    if not path:
        raise ConfigError("--output", "no folder to write: neither --output nor dataset.pretokenized is set",
                          "a folder path")
    folder = Path(os.path.abspath(Path(path).expanduser()))
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError("--output", f"{folder} is a link or a file", "a new folder, or one this command wrote")
    if folder.exists() and not force:
        raise ConfigError("--output", f"{folder} exists", "a new folder, or --force to replace it")
    if folder.exists() and not (folder / META).is_file():
        raise ConfigError("--output", f"{folder} is not a folder this command wrote (no {META}): --force replaces "
                          "only those", "a new folder, or one this command wrote")
    ancestor = next(p for p in folder.parents if p.exists())
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError("--output", f"{folder} cannot be made: {ancestor} is not a writable folder",
                          "a path under a writable folder")
    return folder


def main(argv: list[str]) -> dict:
    """Write the folder for the job of `argv`; returns (and prints) the summary."""
    parser = argparse.ArgumentParser(prog="python -m trainer.pretokenize", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Every other argument is the trainer's: --job.config_file F and "
                                            "--section.key value overrides (see python -m trainer.train --help).")
    parser.add_argument("--output", default="", help="the folder to write (default: dataset.pretokenized)")
    parser.add_argument("--workers", default=str(os.cpu_count() or 1), help="tokenizing processes (default: the CPUs)")
    parser.add_argument("--force", action="store_true", help="replace a folder this command wrote before")
    args, rest = parser.parse_known_args(argv)
    cfg = load_command_config(rest)
    check_fields(cfg)
    check_sections(cfg)
    if not args.workers.isdigit() or int(args.workers) < 1:
        raise ConfigError("--workers", f"{args.workers!r}", "a whole number, 1 or more")
    workers = int(args.workers)
    folder = _output_folder(args.output or cfg.dataset.pretokenized, args.force)
    cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, pretokenized=""))
    tokenizer = job_tokenizer(cfg)
    loader_args = dict(tokenizer=tokenizer, seq_len=1, global_batch_size=1, dp_rank=0, dp_degree=1)
    hold_out = hold_out_every(cfg)
    names = ["train", "validation"] if cfg.validation.enable else ["train"]
    sources = {name: build_loader(cfg, loader_args, hold_out, name == "validation").source for name in names}
    start = time.perf_counter()
    pool = multiprocessing.Pool(workers, _start_worker, (cfg.tokenizer.path,)) if workers > 1 else None
    try:
        splits = {name: (documents_origin(cfg, hold_out, name == "validation"),
                         _Split(cfg, name, source, tokenizer, pool, workers)) for name, source in sources.items()}
        try:
            meta = write_folder(folder, tokenizer_identity(cfg.tokenizer.path, tokenizer), splits, force=args.force)
        except FileExistsError as e:
            raise ConfigError("--output", str(e), "a new folder, or --force to replace it")
    finally:
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    tokens = sum(split["tokens"] for split in meta["splits"].values())
    summary = {
        "output": str(folder),
        "splits": {name: {key: split[key] for key in ("documents", "tokens", "dtype")} | {
            "bytes": split["tokens"] * np.dtype(split["dtype"]).itemsize} for name, split in meta["splits"].items()},
        "workers": workers,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
    }
    print(json.dumps(summary, indent=2))
    return summary


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
