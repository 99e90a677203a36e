"""Train a byte-level BPE and write it as a tiktoken rank file (pure Python; only needs `regex`).

The shipped tokenizer was made with (quick: the corpus has only ~6500 distinct words; timing in docs/data.md):

    python tools/train_bpe.py --input assets/data/pydoc_corpus.jsonl \\
        --ranks 2046 --output assets/tokenizer/pydoc_bpe.tiktoken

2046 mergeable ranks (the 256 single bytes, then 1790 merged tokens in training order) plus the two
special tokens that ``trainer.tokenizer`` appends give the debug model's vocabulary of 2048.

Speed comes from working on distinct words: the text is pre-tokenized with the same regex the
tokenizer uses at run time, identical words are counted once, and each merge only revisits the
words that contain the merged pair (an index pair -> words plus a lazily updated max-heap).
Ties between equally frequent pairs go to the lexicographically smallest byte pair, so the
result is deterministic.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

# The tools directory is not a package; make `trainer` importable when run as a plain script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.tokenizer import DEFAULT_PAT_STR  # noqa: E402


def read_texts(path: Path, text_field: str = "text") -> list[str]:
    """Documents of a ``.jsonl`` file (one JSON object per line) or the whole of any other file."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line)[text_field] for line in f if line.strip()]
    return [path.read_text(encoding="utf-8")]


def count_words(texts: Iterable[str], pat_str: str = DEFAULT_PAT_STR) -> Counter[bytes]:
    """UTF-8 bytes of each pre-tokenized word -> number of occurrences."""
    pattern = regex.compile(pat_str)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(m.encode("utf-8") for m in pattern.findall(text))
    return counts


def _merge_word(symbols: list[int], a: int, b: int, new: int) -> list[int]:
    """Replace each non-overlapping occurrence of the pair (a, b), left to right, by ``new``."""
    out, i, n = [], 0, len(symbols)
    while i < n:
        if i + 1 < n and symbols[i] == a and symbols[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def train_bpe(word_counts: dict[bytes, int], n_ranks: int) -> list[bytes]:
    """Learn merges until there are ``n_ranks`` distinct tokens; return token bytes in rank order.

    Ranks 0..255 are the single bytes; each later rank is the merge learned at that step, so
    tiktoken (which merges lowest rank first) replays training order. A merge whose bytes already
    exist as a token (e.g. "ab"+"c" after "a"+"bc") reuses that token instead of duplicating it.
    """
    if n_ranks < 256:
        raise ValueError(f"n_ranks must be at least 256 (the single bytes), got {n_ranks}")
    vocab = [bytes([b]) for b in range(256)]
    token_id = {t: i for i, t in enumerate(vocab)}
    words = [list(w) for w in word_counts]  # single byte b has token id b
    freqs = list(word_counts.values())

    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (symbols, freq) in enumerate(zip(words, freqs)):
        for pair in zip(symbols, symbols[1:]):
            pair_count[pair] += freq
            pair_words[pair].add(wi)

    # Entries are (-count, left bytes, right bytes, pair); stale ones are skipped on pop.
    heap = [(-c, vocab[a], vocab[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    while len(vocab) < n_ranks:
        while heap and pair_count.get(heap[0][3], 0) != -heap[0][0]:
            heapq.heappop(heap)
        if not heap:
            raise ValueError(f"the text only supports {len(vocab)} tokens, fewer than the {n_ranks} requested")
        _, _, _, (a, b) = heapq.heappop(heap)
        merged = vocab[a] + vocab[b]
        new = token_id.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            token_id[merged] = new

        touched: set[tuple[int, int]] = set()
        for wi in pair_words.pop((a, b)):
            symbols, freq = words[wi], freqs[wi]
            merged_symbols = _merge_word(symbols, a, b, new)
            if len(merged_symbols) == len(symbols):
                continue  # index entry left over from an earlier merge of this word
            for pair in zip(symbols, symbols[1:]):
                pair_count[pair] -= freq
                touched.add(pair)
            for pair in zip(merged_symbols, merged_symbols[1:]):
                pair_count[pair] += freq
                pair_words[pair].add(wi)
                touched.add(pair)
            words[wi] = merged_symbols
        for pair in touched:
            count = pair_count[pair]
            if count > 0:
                heapq.heappush(heap, (-count, vocab[pair[0]], vocab[pair[1]], pair))
            else:
                del pair_count[pair]
    return vocab


def write_rank_file(path: Path, tokens: list[bytes]) -> None:
    """Write ``base64(token) rank`` lines (tiktoken's format; its own writer needs blobfile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens))
    path.write_text("".join(lines), encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help=".jsonl with a text field, or a plain text file")
    parser.add_argument("--output", type=Path, required=True, help="tiktoken rank file to write")
    parser.add_argument("--ranks", type=int, default=2046, help="mergeable ranks incl. the 256 bytes (default 2046)")
    parser.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    texts = read_texts(args.input, args.text_field)
    counts = count_words(texts)
    tokens = train_bpe(counts, args.ranks)
    write_rank_file(args.output, tokens)
    print(
        f"{args.output}: {len(tokens)} ranks from {sum(map(len, texts))} characters "
        f"({len(counts)} distinct words) in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
