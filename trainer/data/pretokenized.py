"""Pre-tokenized data: the token stream of a job's documents, written once by `python -m trainer.pretokenize` and read
back memory-mapped, each rank only its own sequences of each global batch (docs/data.md).

A folder holds, per split ("train", and "validation" when the job validates):

    <split>.tokens  every document's ``[BOS] + tokens + [EOS]``, concatenated in the global order; little-endian
                    uint16 when every id fits, else uint32
    <split>.ends    little-endian int64: the stream offset where each document ends
    meta.json       the format version, the tokenizer's identity, and per split the settings that chose its
                    documents (``origin``), its dtype and its document and token counts

``PretokenizedLoader`` yields the batches of ``PackedDataLoader`` over the same documents and saves the same state,
so a checkpoint of either resumes with the other. Its cost per step is the rank's own slice, a few memory-mapped
reads, whatever the global batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data.loader import GlobalOrderLoader
from trainer.tokenizer import Tokenizer, resolve_path

logger = logging.getLogger(__name__)

FORMAT = 1
META = "meta.json"
_WRITE_CHUNK = 1 << 20
"""Tokens gathered before each write: a few MiB, so a writer's memory does not grow with the corpus."""


def tokenizer_identity(path: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What makes two tokenizers give the same ids: the hash of the file ``path`` names, BOS, EOS and the vocabulary
    size (the file's location is kept for messages only)."""
    resolved = resolve_path(path)
    return {"path": str(resolved.resolve()), "sha256": hashlib.sha256(resolved.read_bytes()).hexdigest(),
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "vocab_size": tokenizer.vocab_size}


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every id."""
    return "<u2" if vocab_size <= 1 << 16 else "<u4"


def write_folder(folder: Path, tokenizer: dict[str, Any], splits: dict[str, tuple[dict, Iterable[np.ndarray]]],
                 force: bool = False) -> dict[str, Any]:
    """Write ``splits`` ({name: (origin, each document's ids)}) into ``folder`` and return its meta.

    The files are written into a hidden sibling folder that is renamed into place at the end, so an error or an
    interrupt leaves nothing at ``folder`` (and removes the parents this call made). An existing ``folder`` is never
    touched without ``force`` (another writer's, finished meanwhile, included); with ``force`` it is moved aside in
    one rename, then deleted, so ``folder`` is always a whole folder, old or new.
    """
    made = next((p for p in reversed(folder.parents) if not p.exists()), None)  # the first parent this call makes
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        dtype = token_dtype(tokenizer["vocab_size"])
        meta: dict[str, Any] = {"format": FORMAT, "tokenizer": tokenizer, "splits": {}}
        for name, (origin, documents) in splits.items():
            meta["splits"][name] = {"origin": origin, "dtype": dtype, **_write_split(partial, name, documents, dtype)}
        (partial / META).write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(partial, folder, force)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return meta


def _move_into_place(partial: Path, folder: Path, force: bool) -> None:
    old = None
    if force and folder.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        folder.rename(old / folder.name)
    try:
        partial.rename(folder)  # refused when folder exists and holds anything
    except OSError as e:
        if old is not None:
            (old / folder.name).rename(folder)
            old.rmdir()
        raise FileExistsError(f"{folder} exists (written meanwhile?): {e.strerror}") from None
    if old is not None:
        shutil.rmtree(old)


def _write_split(folder: Path, name: str, documents: Iterable[np.ndarray], dtype: str) -> dict[str, int]:
    tokens, ends, total, pending, count = [], [], 0, 0, 0
    with open(folder / f"{name}.tokens", "wb") as token_file, open(folder / f"{name}.ends", "wb") as end_file:
        for ids in documents:
            tokens.append(ids)
            total += len(ids)
            pending += len(ids)
            count += 1
            ends.append(total)
            if pending >= _WRITE_CHUNK:
                _flush(tokens, ends, token_file, end_file, dtype)
                pending = 0
        _flush(tokens, ends, token_file, end_file, dtype)
    if not count:
        raise ValueError(f"split {name!r}: no documents")
    return {"documents": count, "tokens": total}


def _flush(tokens: list, ends: list, token_file, end_file, dtype: str) -> None:
    if tokens:
        np.concatenate(tokens).astype(dtype).tofile(token_file)
        np.asarray(ends, dtype="<i8").tofile(end_file)
        tokens.clear()
        ends.clear()


def _count(path: Path, itemsize: int) -> int:
    return path.stat().st_size // itemsize


class PretokenizedSplitError(ValueError):
    """A pre-tokenized folder that does not fit the job; the message says why in one line."""


class TokenStream:
    """One split's tokens, memory-mapped, read as the endless repetition of its documents that the loader cuts
    sequences from: position ``p`` holds token ``p mod tokens`` of the files."""

    def __init__(self, folder: Path, name: str, info: dict[str, Any]) -> None:
        self.description = f"{folder} [{name}]"
        tokens_path, ends_path = folder / f"{name}.tokens", folder / f"{name}.ends"
        dtype = np.dtype(info["dtype"])
        for path, itemsize, want in ((tokens_path, dtype.itemsize, info["tokens"]), (ends_path, 8, info["documents"])):
            if not path.is_file():
                raise PretokenizedSplitError(f"{path} is missing")
            if _count(path, itemsize) != want or path.stat().st_size % itemsize or not want:
                raise PretokenizedSplitError(f"{path} holds {path.stat().st_size} bytes, {META} says {want} x "
                                             f"{itemsize}: the folder is truncated or was changed after writing")
        self.tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
        self.ends = np.memmap(ends_path, dtype="<i8", mode="r")
        self.n_tokens, self.n_documents = len(self.tokens), len(self.ends)
        if int(self.ends[-1]) != self.n_tokens:
            raise PretokenizedSplitError(f"{ends_path} ends at {int(self.ends[-1])}, the tokens are {self.n_tokens}")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the endless stream, as int64."""
        parts = []
        while start < stop:
            offset = start % self.n_tokens
            take = min(stop - start, self.n_tokens - offset)
            parts.append(self.tokens[offset : offset + take])
            start += take
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def end_of(self, k: int) -> int:
        """Where the first ``k`` documents of the endless stream end."""
        passes, index = divmod(k, self.n_documents)
        return passes * self.n_tokens + (int(self.ends[index - 1]) if index else 0)

    def documents_to(self, position: int) -> int:
        """How many documents must be read to hold ``position`` tokens: the least ``k`` with
        ``end_of(k) >= position``, as a loader reading one document at a time would have read."""
        if position <= 0:
            return 0
        passes = (position - 1) // self.n_tokens
        within = position - passes * self.n_tokens
        return passes * self.n_documents + int(np.searchsorted(self.ends, within, side="left")) + 1


class PretokenizedLoader(GlobalOrderLoader):
    """``PackedDataLoader``'s batches and state, from a ``TokenStream``: each rank reads only its own sequences.

    Args:
        stream: the split's tokens.
        seq_len, global_batch_size, dp_rank, dp_degree: see ``GlobalOrderLoader``.
    """

    def __init__(self, stream: TokenStream, seq_len: int, global_batch_size: int, dp_rank: int,
                 dp_degree: int) -> None:
        super().__init__(seq_len, global_batch_size, dp_rank, dp_degree)
        self.stream = stream
        self.description = stream.description
        self.position = 0  # tokens of the endless stream cut into sequences so far, over all ranks
        self.sequences_consumed = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, both ``LongTensor [global_batch_size / dp_degree, seq_len]``."""
        need = self.seq_len + 1
        start = self.position + self.dp_rank * self.local_batch_size * need
        batch = torch.from_numpy(self.stream.read(start, start + self.local_batch_size * need))
        batch = batch.view(self.local_batch_size, need)
        epoch = self._epoch(self.stream.documents_to(self.position)) if self.dp_rank == 0 else 0
        self.position += self.global_batch_size * need
        self.sequences_consumed += self.global_batch_size
        if self.dp_rank == 0 and (now := self._epoch(self.stream.documents_to(self.position))) > epoch:
            logger.info("data: %s exhausted, starting epoch %d", self.description, now)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """The state ``PackedDataLoader`` would save at this position: the documents read (``epoch`` passes and
        ``doc_index`` of the current one), the tokens read but not yet cut (``buffer``) and the global batch."""
        read = self.stream.documents_to(self.position)
        epoch = self._epoch(read)
        return {
            "epoch": epoch,
            "doc_index": read - epoch * self.stream.n_documents,
            "sequences_consumed": self.sequences_consumed,
            "buffer": self.stream.read(self.position, self.stream.end_of(read)).tolist(),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state of either loader; refuse one that does not fit these tokens."""
        self._check_saved(state_dict)
        epoch, doc_index = int(state_dict["epoch"]), int(state_dict["doc_index"])
        buffer = [int(t) for t in state_dict["buffer"]]
        read = epoch * self.stream.n_documents + doc_index
        position = self.stream.end_of(read) - len(buffer)
        fits = (0 <= doc_index <= self.stream.n_documents and position >= 0
                and self.stream.read(position, self.stream.end_of(read)).tolist() == buffer)
        if not fits:
            raise ValueError(f"data loader state (epoch {epoch}, document {doc_index}, {len(buffer)} tokens "
                             f"buffered) does not fit {self.description}: it was saved from other documents or "
                             "another tokenizer")
        self.position = position
        self.sequences_consumed = int(state_dict["sequences_consumed"])

    def _epoch(self, read: int) -> int:
        """The pass a loader that has read ``read`` documents is in (the first document of a pass starts it)."""
        return max(read - 1, 0) // self.stream.n_documents


def read_meta(folder: Path) -> dict[str, Any]:
    """The folder's meta.json, checked for its format.

    Raises:
        PretokenizedSplitError: no such folder or file, unreadable JSON, another format.
    """
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise PretokenizedSplitError(f"{path} not found: not a folder written by `python -m trainer.pretokenize`")
    except (OSError, ValueError) as e:
        raise PretokenizedSplitError(f"{path} cannot be read: {e}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PretokenizedSplitError(f"{path} is format {meta.get('format') if isinstance(meta, dict) else '?'}, "
                                     f"this trainer reads format {FORMAT}")
    splits = meta.get("splits")
    well_formed = isinstance(meta.get("tokenizer"), dict) and isinstance(splits, dict) and all(
        isinstance(info, dict) and isinstance(info.get("origin"), dict) and info.get("dtype") in ("<u2", "<u4")
        and all(isinstance(info.get(key), int) for key in ("documents", "tokens")) for info in splits.values())
    if not well_formed:
        raise PretokenizedSplitError(f"{path} lacks the tokenizer, or a split's origin, dtype or counts")
    return meta


def open_split(folder: Path, meta: dict[str, Any], name: str, origin: dict[str, Any],
               tokenizer: dict[str, Any]) -> TokenStream:
    """The stream of split ``name``, after checking that the folder was written with this tokenizer and from the
    documents ``origin`` describes.

    Raises:
        PretokenizedSplitError: another tokenizer or other documents (naming what differs), a missing split, a
            truncated file.
    """
    written = meta["tokenizer"]
    for key in ("sha256", "bos_id", "eos_id", "vocab_size"):
        if written.get(key) != tokenizer[key]:
            raise PretokenizedSplitError(f"{folder} was written with the tokenizer {written.get('path')} "
                                         f"({key} {written.get(key)}), this run's {tokenizer['path']} has "
                                         f"{key} {tokenizer[key]}")
    if name not in meta["splits"]:
        raise PretokenizedSplitError(f"{folder} has no {name} split (it holds {', '.join(meta['splits'])})")
    info = meta["splits"][name]
    for key, value in origin.items():
        if info["origin"].get(key) != value:
            raise PretokenizedSplitError(f"{folder}'s {name} split was written from {key} "
                                         f"{info['origin'].get(key)!r}, this run's is {value!r}")
    return TokenStream(folder, name, info)
