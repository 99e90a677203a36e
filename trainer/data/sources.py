"""The documents a `[dataset]` section names: local files, the shipped corpus, or a Hugging Face dataset, read in one
fixed order and re-readable from any document index (a resume skips to it)."""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from trainer.data.config import DatasetError
from trainer.tokenizer import resolve_path

# The shipped corpus, made by tools/make_corpus.py; split name -> file relative to the repo root.
PYDOC_FILES = {
    "train": "assets/data/pydoc_corpus.jsonl",
    "validation": "assets/data/pydoc_corpus_val.jsonl",
}

# Dataset names read from the repository itself, without Hugging Face.
LOCAL_DATASETS = ("pydoc",)

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

    def __init__(self, dataset: Any, text_field: str, description: str, key: str = "name",
                 locate: Callable[[], str | None] | None = None,
                 line_of: Callable[[int], str | None] | None = None) -> None:
        self.dataset = dataset
        self.text_field = text_field
        self.description = description
        self.key = key  # the dataset setting a document that cannot be parsed is reported on
        # finds the row a parse error is in (the library names its row within a block, not the document)
        self.locate = locate
        # the file and line of a document, for a document without the text field (local JSON Lines files)
        self.line_of = line_of

    def iter_texts(self, start: int) -> Iterator[str]:
        """Texts from index ``start`` on; raises ``DatasetError`` on a missing or non-string field, or a document
        that cannot be parsed."""
        examples = iter(self.dataset.skip(start) if start else self.dataset)
        index = start
        while True:
            try:
                example = next(examples)
            except StopIteration:
                return
            except ValueError as e:  # pyarrow's parse errors (ArrowInvalid) are ValueErrors
                where = self.locate() if self.locate is not None else None
                if where is not None:
                    raise DatasetError(self.key, f"{self.description}: {where}") from None
                raise DatasetError(self.key, f"{self.description}: document {index} cannot be read: {e}") from None
            text = example.get(self.text_field)
            if not isinstance(text, str):
                # json files share one schema: a field another document has is None here, not absent
                present = [k for k, v in example.items() if v is not None]
                fields = ", ".join(k for k, v in example.items() if isinstance(v, str)) or "none"
                line = self.line_of(index) if self.line_of is not None else None
                document = f"{line} (document {index})" if line else f"document {index}"
                # the first document decides the field; a later one without it is a fault of that document
                allowed = (f"a string field the documents have: {fields}" if index == 0 else
                           f"documents that all have a string {self.text_field!r}: fix or remove {document}")
                raise DatasetError(
                    "text_field",
                    f"{self.description}: {document} has no string field {self.text_field!r} "
                    f"(its fields: {', '.join(present) or 'none'})",
                    allowed,
                )
            yield text
            index += 1


class HeldOutDocuments:
    """A validation split for documents that have none: every ``every``-th document, or all the others.

    ``held_out=True`` keeps documents ``every - 1``, ``2 * every - 1``, ... of ``source`` (the 25th, 50th, ...
    for ``every = 25``); ``held_out=False`` keeps the rest. The two never share a document, keep the source's
    order, and number their own documents from 0, so they resume by index like any other source.
    """

    def __init__(self, source: DocumentSource, every: int, held_out: bool) -> None:
        if every < 2:
            raise ValueError(f"every must be >= 2, got {every}")
        self.source = source
        self.every = every
        self.held_out = held_out
        which = "1 in" if held_out else "all but 1 in"
        self.description = f"{source.description}, {which} every {every} documents"

    def iter_texts(self, start: int) -> Iterator[str]:
        """Texts of this part's documents ``start``, ``start + 1``, ...; reads the source from the first of them."""
        k = self.every
        # Index in the source of this part's document `start`: held-out ones sit at k-1, 2k-1, ...; the others
        # fill the k-1 places before each of those.
        first = start * k + k - 1 if self.held_out else start + start // (k - 1)
        for index, text in enumerate(self.source.iter_texts(first), start=first):
            if (index % k == k - 1) == self.held_out:
                yield text


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
            raise DatasetError("path", f"dataset directory {str(path)!r} holds no {kinds} files")
    elif path.suffix.lower() in _BUILDERS:
        files = [path]
    else:
        raise DatasetError("path", f"dataset file {str(path)!r} is not one of {kinds}")
    builders = sorted({_BUILDERS[p.suffix.lower()] for p in files})
    if len(builders) > 1:
        raise DatasetError("path", f"dataset directory {str(path)!r} mixes file types ({', '.join(builders)})",
                           "a directory of one file type")
    return builders[0], [str(p) for p in files]


def _blank(file: str) -> bool:
    """Whether a text file holds nothing but whitespace; reads only up to its first other byte."""
    with open(file, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _import_datasets(allow_download: bool) -> Any:
    """The ``datasets`` module, offline unless ``allow_download``.

    Hugging Face libraries read their offline switch once, when first imported, and the trainer imports them only
    here; so a run that does not allow downloads sets it first. With ``allow_download`` the environment is left
    as the user has it (an exported ``HF_HUB_OFFLINE=1`` still keeps the run offline).
    """
    if not allow_download:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets  # imported here: it takes about a second and the default corpus does not need it

    # Its JSON reader logs an error line for a file it cannot parse before raising; the trainer reports that error
    # itself in one line naming the file, line and document (`_first_bad_json_line`).
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    return datasets


def _json_lines(files: list[str]) -> Iterator[tuple[str, int, str] | None]:
    """(file, line number, line) of every non-blank line of JSON Lines `files`, in order: the loader's documents.
    A `.json` file that parses as a whole (one JSON value, not JSON Lines) gives one None: its documents are not
    lines, and the documents after it cannot be counted from here."""
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if file.endswith(".json"):
            try:
                json.loads(text)
            except json.JSONDecodeError:
                pass
            else:
                yield None
                continue
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                yield file, number, line


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where the first line of JSON Lines `files` that is not valid JSON is: `file line L (document D): why`, with D
    counted as the loader counts documents (left out after a whole-JSON file); None if every line parses."""
    document: int | None = 0
    for row in _json_lines(files):
        if row is None:
            document = None
            continue
        file, number, line = row
        try:
            json.loads(line)
        except json.JSONDecodeError as e:
            which = f" (document {document})" if document is not None else ""
            return f"{file} line {number}{which} is not valid JSON: {e.msg} (column {e.colno})"
        if document is not None:
            document += 1
    return None


def _json_document_line(files: list[str], index: int) -> str | None:
    """`file line L` of document `index` of JSON Lines `files`; None if it cannot be told (a whole-JSON file before
    it, or fewer documents)."""
    for document, row in enumerate(_json_lines(files)):
        if row is None:
            return None
        if document == index:
            return f"{row[0]} line {row[1]}"
    return None


def _load_hf(datasets: Any, split: str, key: str, what: str, locate: Callable[[], str | None] | None = None,
             **kwargs: Any) -> Any:
    """``datasets.load_dataset(**kwargs)``; a split it lacks becomes a ``DatasetError`` on ``split``, a file it
    cannot parse one on ``key`` naming the file and row (`locate`, where given, finds the row)."""
    try:
        return datasets.load_dataset(split=split, **kwargs)
    except datasets.exceptions.DatasetGenerationError as e:
        # Its own message only says that generation failed; the cause names the file and a row within a block.
        where = locate() if locate is not None else None
        raise DatasetError(key, f"{what}: {where}" if where else f"{what} cannot be read: {e.__cause__ or e}") from None
    except ValueError as e:
        if "split" not in str(e).lower():
            raise DatasetError(key, f"{what} cannot be read: {e}") from None
        raise DatasetError("split", f"{what}: {e}", "a split the dataset has") from None


def _unknown_name(name: str, error: Exception, offline: bool, allow_download: bool) -> DatasetError:
    """The error for a name that is neither a local dataset nor a Hugging Face dataset within reach."""
    close = difflib.get_close_matches(name, LOCAL_DATASETS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if offline and not allow_download:
        problem = (f"{name!r} is neither a local dataset nor in the Hugging Face cache, and downloads are off "
                   f"(offline mode, dataset.allow_download = false){hint}")
    elif offline:
        problem = (f"{name!r} is neither a local dataset nor in the Hugging Face cache, and offline mode is on "
                   f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set in the environment){hint}")
    elif isinstance(error, ConnectionError):
        problem = (f"{name!r} is neither a local dataset nor in the Hugging Face cache, and the Hub cannot be "
                   f"reached ({error}){hint}")
    else:
        problem = f"{name!r} is not a local dataset and the Hugging Face Hub does not serve it ({error}){hint}"
    local = ", ".join(LOCAL_DATASETS)
    return DatasetError("name", problem, f"{local} (shipped), local files with dataset.path, or a Hugging Face "
                                         "dataset with dataset.allow_download = true")


def load_documents(dataset_cfg: Any, split: str) -> DocumentSource:
    """The documents that ``dataset_cfg`` names, for ``split``.

    ``dataset_cfg`` provides ``name``, and optionally ``path`` (default none), ``streaming``
    (default False), ``text_field`` (default "text") and ``allow_download`` (default False).
    Sources, in priority order:

    * ``path``: a local json/jsonl/parquet/txt file or a directory of them, through
      ``datasets.load_dataset`` (``.txt`` files give one document per blank-line-separated
      paragraph); ``split`` is passed on (local files form one split, "train"; slices such as
      ``"train[:5%]"`` work without streaming);
    * ``name == "pydoc"``: the shipped corpus, read directly (split "train" or "validation");
    * any other ``name``: a Hugging Face dataset, from the local HF cache, or from the Hub when
      ``allow_download`` is true. Without ``allow_download`` Hugging Face runs in offline mode.

    Raises:
        DatasetError: missing path, unknown name or split, or a file type that cannot be read; ``key``
            names the setting at fault.
    """
    path = getattr(dataset_cfg, "path", None)
    streaming = bool(getattr(dataset_cfg, "streaming", False))
    text_field = getattr(dataset_cfg, "text_field", None) or "text"
    allow_download = bool(getattr(dataset_cfg, "allow_download", False))
    if path:
        resolved = resolve_path(path)
        if not resolved.exists():
            raise DatasetError("path", f"dataset path {str(path)!r} not found")
        builder, files = _local_data_files(resolved)
        if builder != "parquet" and all(map(_blank, files)):
            # the datasets library cannot read zero rows (its JSON reader ends in StopIteration): no documents
            return ListDocuments([], f"{path} [{split}]")
        datasets = _import_datasets(allow_download)
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        locate = functools.partial(_first_bad_json_line, files) if builder == "json" else None
        dataset = _load_hf(datasets, split, "path", repr(str(path)), locate, path=builder, data_files=files,
                           streaming=streaming, **kwargs)
        # a slice of the split ("train[10:]") numbers its documents from its own start: no line is named then
        line_of = functools.partial(_json_document_line, files) if builder == "json" and "[" not in split else None
        return HFDocuments(dataset, text_field, f"{path} [{split}]", key="path", locate=locate, line_of=line_of)

    name = dataset_cfg.name
    if name == "pydoc":
        if split not in PYDOC_FILES:
            raise DatasetError("split", f"dataset 'pydoc' has splits {', '.join(PYDOC_FILES)}, not {split!r}",
                               ", ".join(PYDOC_FILES))
        corpus = resolve_path(PYDOC_FILES[split])
        try:
            with corpus.open(encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for line in f if line.strip()]
        except OSError as e:
            raise DatasetError("name", f"pydoc corpus {str(corpus)!r} cannot be read: {e.strerror or e}") from None
        return ListDocuments(texts, f"pydoc [{split}]")

    datasets = _import_datasets(allow_download)
    try:
        dataset = _load_hf(datasets, split, "name", repr(name), path=name, streaming=streaming)
    except (ConnectionError, FileNotFoundError) as e:
        # Offline and not cached: ConnectionError; online but unknown to the Hub: FileNotFoundError.
        raise _unknown_name(name, e, datasets.config.HF_HUB_OFFLINE, allow_download) from None
    return HFDocuments(dataset, text_field, f"{name} [{split}]")


def has_documents(source: DocumentSource) -> bool:
    """Whether ``source`` has a document; reads the first one, so a wrong text field fails before training.

    Raises:
        DatasetError: on ``text_field`` when the first document lacks it.
    """
    return next(iter(source.iter_texts(0)), None) is not None
