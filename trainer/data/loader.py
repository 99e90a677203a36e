"""Packed-sequence data loading with one global order that does not depend on the parallel layout.

The rule (see docs/data.md):

* documents are read in one fixed order; each becomes ``[BOS] + tokens + [EOS]``;
* the concatenated token stream is cut, in order, into sequences of ``seq_len + 1`` tokens;
  a sequence gives ``inputs = seq[:-1]`` and ``labels = seq[1:]``;
* step ``k`` consumes the global batch of sequences ``[k*G, (k+1)*G)`` (``G`` = global batch size);
  data-parallel rank ``r`` of ``D`` keeps the contiguous slice ``[r*G/D, (r+1)*G/D)``.

``PackedDataLoader`` tokenizes as it reads: every rank reads and tokenizes the whole stream and drops what other
ranks train on. ``trainer.data.pretokenized.PretokenizedLoader`` reads the same stream from token files written
once, each rank only its own slice. Either way the sequences of a step are the same for any DP degree or
gradient-accumulation split, and the loader state is global and the same for both: a checkpoint resumes on any
number of ranks, with either loader.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from trainer.data.sources import DocumentSource, HeldOutDocuments, load_documents
from trainer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GlobalOrderLoader:
    """What every loader of the global order shares: the layout of the global batch over the data-parallel ranks,
    and the checks of a saved position. Subclasses hold the stream position and yield the batches.

    Args:
        seq_len: tokens per training sequence (each sequence reads ``seq_len + 1`` tokens).
        global_batch_size: sequences per optimizer step over all data-parallel ranks.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_degree: number of data-parallel ranks; must divide ``global_batch_size``.
    """

    def __init__(self, seq_len: int, global_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch_size ({global_batch_size}) must be positive")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_degree={dp_degree})")
        if global_batch_size % dp_degree:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by the data-parallel degree {dp_degree}"
            )
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.local_batch_size = global_batch_size // dp_degree

    def _check_saved(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state without the position's keys; log (rank 0) a global batch that differs from the saved one."""
        missing = {"epoch", "doc_index", "sequences_consumed", "buffer"} - set(state_dict)
        if missing:
            raise ValueError(f"data loader state lacks {', '.join(sorted(missing))}")
        saved_batch = state_dict.get("global_batch_size", self.global_batch_size)  # states before it: unknown
        if saved_batch != self.global_batch_size and self.dp_rank == 0:
            logger.info("data: the checkpoint was trained with %d sequences per step, this run trains with %d "
                        "(training.global_batch_size)", saved_batch, self.global_batch_size)


class PackedDataLoader(GlobalOrderLoader):
    """Yields this rank's share of each global batch of packed sequences, tokenizing the documents as it reads them;
    checkpointable.

    Args:
        source: the documents, in their global order.
        tokenizer: supplies the token ids, BOS and EOS.
        seq_len, global_batch_size, dp_rank, dp_degree: see ``GlobalOrderLoader``.

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
        super().__init__(seq_len, global_batch_size, dp_rank, dp_degree)
        self.source = source
        self.tokenizer = tokenizer

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
        """The global stream position (plain ints and a list of ints; the same on every rank), and the global batch
        it was read with (a resume keeps it, `trainer/prepare.py`)."""
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "sequences_consumed": self.sequences_consumed,
            "buffer": self._buffer[self._pos :],
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (possibly saved with another DP degree, rank or global batch: the stream
        goes on from the same sequence, and a changed global batch is logged)."""
        self._check_saved(state_dict)
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


def build_dataloader(
    dataset_cfg: Any,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split_override: str | None = None,
    hold_out_every: int = 0,
    held_out: bool = False,
) -> PackedDataLoader:
    """A ``PackedDataLoader`` over the documents of ``dataset_cfg`` (see ``load_documents``).

    ``split_override`` replaces ``dataset_cfg.split`` (default "train"), e.g. "validation" for an
    evaluation loader built from the training dataset's config. ``hold_out_every`` > 0 splits the
    documents with ``HeldOutDocuments``: every ``hold_out_every``-th one (``held_out``) or the others.
    """
    split = split_override or getattr(dataset_cfg, "split", None) or "train"
    source = load_documents(dataset_cfg, split)
    if hold_out_every:
        source = HeldOutDocuments(source, hold_out_every, held_out)
    return PackedDataLoader(source, tokenizer, seq_len, global_batch_size, dp_rank, dp_degree)
