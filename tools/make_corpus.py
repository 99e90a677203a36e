"""Build the default offline corpus from the English documentation that ships with Python.

``pydoc_data.topics.topics`` (a dict: topic name -> help text, about 0.5 MB of prose and code
examples from the language reference) is split into documents of a few hundred to ~2000
characters, written as JSON lines ``{"text": ...}``, and 4% of them are held out for validation:

    python tools/make_corpus.py            # writes assets/data/pydoc_corpus{,_val}.jsonl

The output is a pure function of the topics text, so it is byte-identical on every run with the
same Python; the committed files were made with Python ``REFERENCE_PYTHON`` (other versions ship
slightly different documentation and therefore a slightly different corpus).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

REFERENCE_PYTHON = "3.11.7"

TRAIN_FILE = "pydoc_corpus.jsonl"
VAL_FILE = "pydoc_corpus_val.jsonl"

TARGET_CHARS = 1000  # a document is closed once it reaches this size ...
MAX_CHARS = 2000  # ... and never grows past this unless a single line is longer
MIN_CHARS = 300  # a shorter last piece of a topic joins the previous document if that fits
VAL_EVERY = 25  # every 25th document of the shuffled order is validation (4%)

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")


def _is_heading(paragraph: str) -> bool:
    """reST-style heading: a title line underlined with a run of one punctuation character."""
    lines = paragraph.split("\n")
    return len(lines) == 2 and bool(_UNDERLINE.match(lines[1].strip()))


def _split_long(paragraph: str) -> list[str]:
    """Cut a paragraph longer than MAX_CHARS (big tables, grammar blocks) at line boundaries."""
    if len(paragraph) <= MAX_CHARS:
        return [paragraph]
    pieces, current = [], ""
    for line in paragraph.split("\n"):
        if current and len(current) + 1 + len(line) > MAX_CHARS:
            pieces.append(current)
            current = line
        else:
            current = f"{current}\n{line}" if current else line
    pieces.append(current)
    return pieces


def split_topic(text: str) -> list[str]:
    """Group one topic's paragraphs into documents of about TARGET_CHARS..MAX_CHARS characters.

    A document is not closed right after a heading, so headings stay with the text they introduce,
    and a short tail joins the document before it rather than standing alone out of context.
    """
    paragraphs = [
        piece
        for p in _PARAGRAPH_BREAK.split(text)
        if p.strip()
        for piece in _split_long(p.rstrip())
    ]
    docs, current = [], ""
    for p in paragraphs:
        if current and len(current) + 2 + len(p) > MAX_CHARS:
            docs.append(current)
            current = ""
        current = f"{current}\n\n{p}" if current else p
        if len(current) >= TARGET_CHARS and not _is_heading(p):
            docs.append(current)
            current = ""
    if current:
        if docs and len(current) < MIN_CHARS and len(docs[-1]) + 2 + len(current) <= MAX_CHARS:
            docs[-1] = f"{docs[-1]}\n\n{current}"
        else:
            docs.append(current)
    return docs


def build_documents(topics: dict[str, str]) -> tuple[list[str], list[str]]:
    """All documents in a fixed shuffled order (sorted by SHA-256 of their text), split train/val.

    Hash order mixes topics so that consecutive training batches are not all about one subject,
    while staying independent of dict order and of the machine.
    """
    docs = [doc for name in sorted(topics) for doc in split_topic(topics[name])]
    docs.sort(key=lambda d: (hashlib.sha256(d.encode("utf-8")).hexdigest(), d))
    train = [d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val


def write_jsonl(path: Path, docs: list[str]) -> int:
    """Write ``{"text": doc}`` lines (UTF-8, ``\\n`` endings); return the byte size."""
    data = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    path.write_bytes(data)
    return len(data)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "assets" / "data",
        help="directory for pydoc_corpus.jsonl and pydoc_corpus_val.jsonl (default: assets/data)",
    )
    args = parser.parse_args(argv)

    from pydoc_data.topics import topics

    train, val = build_documents(topics)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in ((TRAIN_FILE, train), (VAL_FILE, val)):
        size = write_jsonl(args.out_dir / name, docs)
        print(f"{args.out_dir / name}: {len(docs)} documents, {size} bytes")


if __name__ == "__main__":
    main()
