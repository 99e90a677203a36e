"""Packed-sequence data loading with one global order that does not depend on the parallel layout.

The rule (see docs/data.md):

* documents are read in one fixed order; each becomes ``[BOS] + tokens + [EOS]``;
* the concatenated token stream is cut, in order, into sequences of ``seq_len + 1`` tokens;
  a sequence gives ``inputs = seq[:-1]`` and ``labels = seq[1:]``;
* step ``k`` consumes the global batch of sequences ``[k*G, (k+1)*G)`` (``G`` = global batch size);
  data-parallel rank ``r`` of ``D`` keeps the contiguous slice ``[r*G/D, (r+1)*G/D)``.

Every rank reads and tokenizes the whole stream and drops what other ranks train on, so the
sequences of a step are the same for any DP degree or gradient-accumulation split, and the
loader state is global: a checkpoint resumes on any number of ranks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.tokenizer import Tokenizer, resolve_path

__all__ = [
    "PYDOC_FILES",
    "DocumentSource",
    "HFDocuments",
    "ListDocuments",
    "PackedDataLoader",
    "build_dataloader",
    "load_documents",
]

logger = logging.getLogger(__name__)

# The shipped corpus, made by tools/make_corpus.py; split name -> file relative to the repo root.
PYDOC_FILES = {
    "train": "assets/data/pydoc_corpus.jsonl",
    "validation": "assets/data/pydoc_corpus_val.jsonl",
}

# Local file suffix -> the `datasets` builder that reads it.
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DocumentSource(Protocol):
    """An ordered, re-readable collection of documents."""

    description: str

    def iter_texts(self, start: int) -> Iterator[str]:
        """The texts of documents ``start``, ``start + 1``, ... to the end of one pass."""
        ...


class ListDocuments:
    """Documents held in memory (the shipped corpus, tests)."""

    def __init__(self, texts: list[str], description: str = "in-memory documents") -> None:
        self.texts = texts
        self.description = description

    def iter_texts(self, start: int) -> Iterator[str]:
        """Texts from index ``start`` on; skipping is a slice."""
        return iter(self.texts[start:])


class HFDocuments:
    """Documents of a Hugging Face ``Dataset`` or ``IterableDataset``, read from one field.

    Skipping uses ``dataset.skip(n)``: an index remap for map-style datasets, and a read without
    tokenization for streaming ones.
    """

    def __init__(self, dataset: Any, text_field: str, description: str) -> None:
        self.dataset = dataset
        self.text_field = text_field
        self.description = description

    def iter_texts(self, start: int) -> Iterator[str]:
        """Texts from index ``start`` on; raises ``ValueError`` on a missing or non-string field."""
        dataset = self.dataset.skip(start) if start else self.dataset
        for index, example in enumerate(dataset, start=start):
            text = example.get(self.text_field)
            if not isinstance(text, str):
                raise ValueError(
                    f"{self.description}: document {index} has no string field {self.text_field!r} "
                    f"(fields: {', '.join(example)})"
                )
            yield text


class PackedDataLoader:
    """Yields this rank's share of each global batch of packed sequences; checkpointable.

    Args:
        source: the documents, in their global order.
        tokenizer: supplies the token ids, BOS and EOS.
        seq_len: tokens per training sequence (each sequence reads ``seq_len + 1`` tokens).
        global_batch_size: sequences per optimizer step over all data-parallel ranks.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_degree: number of data-parallel ranks; must divide ``global_batch_size``.

    When the documents run out the stream restarts from the first document (``epoch`` += 1);
    tokens left over from the previous pass carry into the next, so no token is dropped.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ) -> None:
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) must be positive")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_degree={dp_degree})")
        if global_batch_size % dp_degree:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by the data-parallel degree {dp_degree}"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.local_batch_size = global_batch_size // dp_degree

        # Global stream position: everything a resume needs, identical on every rank.
        self.epoch = 0
        self.doc_index = 0  # next document of the current pass
        self.sequences_consumed = 0  # over all ranks and steps
        self._buffer: list[int] = []  # tokenized but not yet cut into a sequence: _buffer[_pos:]
        self._pos = 0
        self._docs: Iterator[str] | None = None  # opened lazily at doc_index

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, both ``LongTensor [global_batch_size / dp_degree, seq_len]``."""
        first = self.dp_rank * self.local_batch_size
        mine = []
        for i in range(self.global_batch_size):
            sequence = self._next_sequence()
            if first <= i < first + self.local_batch_size:
                mine.append(sequence)
        self.sequences_consumed += self.global_batch_size
        batch = torch.tensor(mine, dtype=torch.long)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """The global stream position (plain ints and a list of ints; the same on every rank)."""
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "sequences_consumed": self.sequences_consumed,
            "buffer": self._buffer[self._pos :],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (possibly saved with another DP degree or rank)."""
        missing = {"epoch", "doc_index", "sequences_consumed", "buffer"} - set(state_dict)
        if missing:
            raise ValueError(f"data loader state lacks {', '.join(sorted(missing))}")
        self.epoch = int(state_dict["epoch"])
        self.doc_index = int(state_dict["doc_index"])
        self.sequences_consumed = int(state_dict["sequences_consumed"])
        self._buffer = [int(t) for t in state_dict["buffer"]]
        self._pos = 0
        self._docs = None

    def _next_sequence(self) -> list[int]:
        need = self.seq_len + 1
        while len(self._buffer) - self._pos < need:
            # Compact before growing so the buffer stays about one document long.
            del self._buffer[: self._pos]
            self._pos = 0
            self._buffer.extend(self._next_document_tokens())
        sequence = self._buffer[self._pos : self._pos + need]
        self._pos += need
        return sequence

    def _next_document_tokens(self) -> list[int]:
        if self._docs is None:
            self._docs = self.source.iter_texts(self.doc_index)
        text = next(self._docs, None)
        if text is None:
            if self.doc_index == 0:
                raise ValueError(f"{self.source.description}: no documents")
            self.epoch += 1
            self.doc_index = 0
            self._docs = self.source.iter_texts(0)
            if self.dp_rank == 0:
                logger.info("data: %s exhausted, starting epoch %d", self.source.description, self.epoch)
            text = next(self._docs)
        self.doc_index += 1
        return self.tokenizer.encode(text, bos=True, eos=True)


def _local_data_files(path: Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and sorted file list for a file or a directory of files."""
    kinds = "/".join(sorted(_BUILDERS))
    if path.is_dir():
        # Hidden files and folders (caches, editor state) are skipped, as `datasets` itself does.
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in _BUILDERS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"dataset directory {str(path)!r} holds no {kinds} files")
    elif path.suffix.lower() in _BUILDERS:
        files = [path]
    else:
        raise ValueError(f"dataset file {str(path)!r} is not one of {kinds}")
    builders = sorted({_BUILDERS[p.suffix.lower()] for p in files})
    if len(builders) > 1:
        raise ValueError(f"dataset directory {str(path)!r} mixes file types ({', '.join(builders)}); use one")
    return builders[0], [str(p) for p in files]


def load_documents(dataset_cfg: Any, split: str) -> DocumentSource:
    """The documents that ``dataset_cfg`` names, for ``split``.

    ``dataset_cfg`` provides ``name``, and optionally ``path`` (default none), ``streaming``
    (default False) and ``text_field`` (default "text"). Sources, in priority order:

    * ``path``: a local json/jsonl/parquet/txt file or a directory of them, through
      ``datasets.load_dataset`` (``.txt`` files give one document per blank-line-separated
      paragraph); ``split`` is passed on (local files form one split, "train"; slices such as
      ``"train[:5%]"`` work without streaming);
    * ``name == "pydoc"``: the shipped corpus, read directly (split "train" or "validation");
    * any other ``name``: a Hugging Face Hub dataset (needs network or a warm HF cache).

    Raises:
        ValueError: missing path, unknown pydoc split, or a file type that cannot be read.
    """
    path = getattr(dataset_cfg, "path", None)
    streaming = bool(getattr(dataset_cfg, "streaming", False))
    text_field = getattr(dataset_cfg, "text_field", None) or "text"
    if path:
        resolved = resolve_path(path)
        if not resolved.exists():
            raise ValueError(f"dataset path {str(path)!r} not found")
        builder, files = _local_data_files(resolved)
        import datasets  # imported here: it takes about a second and the default corpus skips it

        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        dataset = datasets.load_dataset(builder, data_files=files, split=split, streaming=streaming, **kwargs)
        return HFDocuments(dataset, text_field, f"{path} [{split}]")

    name = dataset_cfg.name
    if name == "pydoc":
        if split not in PYDOC_FILES:
            raise ValueError(f"dataset 'pydoc' has splits {', '.join(PYDOC_FILES)}, not {split!r}")
        corpus = resolve_path(PYDOC_FILES[split])
        try:
            with corpus.open(encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"pydoc corpus {str(corpus)!r} cannot be read: {e.strerror or e}") from None
        return ListDocuments(texts, f"pydoc [{split}]")

    import datasets

    dataset = datasets.load_dataset(name, split=split, streaming=streaming)
    return HFDocuments(dataset, text_field, f"{name} [{split}]")


def build_dataloader(
    dataset_cfg: Any,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split_override: str | None = None,
) -> PackedDataLoader:
    """A ``PackedDataLoader`` over the documents of ``dataset_cfg`` (see ``load_documents``).

    ``split_override`` replaces ``dataset_cfg.split`` (default "train"), e.g. "validation" for an
    evaluation loader built from the training dataset's config.
    """
    split = split_override or getattr(dataset_cfg, "split", None) or "train"
    source = load_documents(dataset_cfg, split)
    return PackedDataLoader(source, tokenizer, seq_len, global_batch_size, dp_rank, dp_degree)
