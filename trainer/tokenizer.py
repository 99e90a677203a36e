"""Byte-level BPE tokenizer on top of tiktoken, loaded from a local file only.

Two file formats are understood:

* a tiktoken rank file (lines ``base64(token_bytes) rank``), such as the shipped
  ``assets/tokenizer/pydoc_bpe.tiktoken``; the special tokens ``<|begin_of_text|>`` and
  ``<|end_of_text|>`` are appended right after the highest rank;
* a Hugging Face ``tokenizer.json`` holding a byte-level BPE (DeepSeek-V3's own format),
  converted to tiktoken ranks on load.

Nothing here touches the network. Every problem with the file surfaces as one ``ValueError``
that names the path, so the caller can print it and exit with code 2.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import tiktoken


@dataclass
class TokenizerSection:
    """The tokenizer."""

    path: str = "assets/tokenizer/pydoc_bpe.tiktoken"
    """A tiktoken rank file or a Hugging Face tokenizer.json."""


__all__ = [
    "BOS_TOKEN",
    "DEFAULT_PAT_STR",
    "EOS_TOKEN",
    "Tokenizer",
    "build_tokenizer",
    "bytes_to_unicode",
    "resolve_path",
]

REPO_ROOT = Path(__file__).resolve().parents[1]

# Pre-tokenizer split in the style of GPT-4/Llama 3: contractions, letter runs with one leading
# non-letter, digit groups of at most three, punctuation runs, newlines, and indentation. It is
# written without possessive quantifiers so that Python's `regex` (used by tools/train_bpe.py)
# and tiktoken's Rust engine split text identically.
DEFAULT_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# GPT-2's ByteLevel pre-tokenizer regex, used when a tokenizer.json asks for ByteLevel splitting.
_GPT2_PAT_STR = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# Names tried, in order, when a tokenizer.json does not say which added tokens are BOS/EOS.
_BOS_CANDIDATES = ("<｜begin▁of▁sentence｜>", BOS_TOKEN, "<s>", "<|endoftext|>")
_EOS_CANDIDATES = ("<｜end▁of▁sentence｜>", EOS_TOKEN, "</s>", "<|endoftext|>")


def resolve_path(path: str | Path) -> Path:
    """Resolve ``path``: absolute as is; relative against the current directory, then the repo root.

    The repo-root fallback lets defaults such as ``assets/tokenizer/pydoc_bpe.tiktoken`` work from
    any working directory. If neither candidate exists, the current-directory one is returned so
    that error messages name what the user typed.
    """
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the remaining bytes (controls, space, ...) map to
    code points from 256 upwards in byte order. Hugging Face byte-level BPE vocabularies store
    their tokens as strings in this alphabet.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    """A byte-level BPE tokenizer with BOS/EOS ids, backed by a ``tiktoken.Encoding``.

    Args:
        name: a label for the encoding (shown in reprs and errors).
        mergeable_ranks: token bytes -> id; must contain all 256 single bytes.
        special_tokens: special token string -> id; must contain ``bos_token`` and ``eos_token``.
        pat_str: the pre-tokenizer regex (tiktoken/fancy-regex syntax).
        bos_token: the special token prepended when ``encode(..., bos=True)``.
        eos_token: the special token appended when ``encode(..., eos=True)``.
    """

    def __init__(
        self,
        name: str,
        mergeable_ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        pat_str: str,
        bos_token: str,
        eos_token: str,
    ) -> None:
        self._encoding = tiktoken.Encoding(
            name, pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        self._bos_id = special_tokens[bos_token]
        self._eos_id = special_tokens[eos_token]

    @property
    def vocab_size(self) -> int:
        """Number of ids the model must embed: the highest token id + 1."""
        return self._encoding.n_vocab

    @property
    def bos_id(self) -> int:
        """Id of the begin-of-text token."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of the end-of-text token."""
        return self._eos_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in BOS/EOS.

        Special-token strings inside ``text`` are encoded as ordinary text: training data must not
        be able to inject control tokens.
        """
        ids = self._encoding.encode_ordinary(text)
        if bos:
            ids.insert(0, self._bos_id)
        if eos:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (a list, or a 1-D tensor); invalid UTF-8 becomes U+FFFD."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._encoding.decode(ids)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._encoding.name!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id})"
        )


def build_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a tiktoken rank file or a Hugging Face ``tokenizer.json``.

    A path ending in ``.json`` is read as ``tokenizer.json`` (with an optional
    ``tokenizer_config.json`` next to it naming BOS/EOS); anything else as a tiktoken rank file.
    The file is parsed on every call (no cache keyed by path, unlike
    ``tiktoken.load.load_tiktoken_bpe``), so a file rewritten in place is picked up.

    Raises:
        ValueError: the file is missing, unreadable or not a valid tokenizer (one line, naming it).
    """
    resolved = resolve_path(path)
    try:
        raw = resolved.read_bytes()
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else " (looked in the current directory and the repo root)"
        raise ValueError(f"tokenizer file {str(path)!r} not found{where}") from None
    except OSError as e:
        raise ValueError(f"tokenizer file {str(resolved)!r} cannot be read: {e.strerror or e}") from None
    if resolved.name.endswith(".json"):
        return _from_hf_tokenizer_json(resolved, raw)
    return _from_tiktoken_file(resolved, raw)


def _from_tiktoken_file(path: Path, raw: bytes) -> Tokenizer:
    """Parse a rank file and append BOS/EOS right after the highest rank."""
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64_token rank'")
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"tokenizer file {str(path)!r} is corrupt at line {lineno}: {e}") from None
        if token in ranks or rank in seen_ranks or rank < 0:
            raise ValueError(
                f"tokenizer file {str(path)!r} is corrupt at line {lineno}: duplicate or negative token/rank"
            )
        ranks[token] = rank
        seen_ranks.add(rank)
    _check_byte_coverage(path, ranks)
    first_special = max(seen_ranks) + 1
    specials = {BOS_TOKEN: first_special, EOS_TOKEN: first_special + 1}
    return _make(path, ranks, specials, DEFAULT_PAT_STR, BOS_TOKEN, EOS_TOKEN)


def _from_hf_tokenizer_json(path: Path, raw: bytes) -> Tokenizer:
    """Convert a byte-level BPE ``tokenizer.json``: vocab ids become tiktoken ranks.

    tiktoken merges by the rank of the merged bytes, so this reproduces Hugging Face's output
    when the vocab ids follow the merge order, which holds for GPT-2-style vocabularies such as
    DeepSeek-V3's.
    """

    def bad(problem: str) -> ValueError:
        return ValueError(f"tokenizer file {str(path)!r} {problem}")

    try:
        data = json.loads(raw)
        model = data["model"]
        vocab = model["vocab"]
    except (ValueError, KeyError, TypeError) as e:
        raise bad(f"is not a Hugging Face tokenizer.json ({type(e).__name__}: {e})") from None
    if model.get("type", "BPE") != "BPE" or not isinstance(vocab, dict):
        raise bad(f"holds a {model.get('type')!r} model; only byte-level BPE is supported")

    try:
        specials = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"has a malformed 'added_tokens' entry ({type(e).__name__}: {e})") from None
    special_ids = set(specials.values())

    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token in specials or token_id in special_ids:
            continue  # added tokens can also sit in model.vocab (DeepSeek-V3); tiktoken wants them once
        try:
            ranks[bytes(byte_of[ch] for ch in token)] = int(token_id)
        except KeyError:
            raise bad(
                f"has vocab token {token!r} (id {token_id}) outside the GPT-2 byte-level alphabet; "
                "only byte-level BPE tokenizers are supported"
            ) from None
    _check_byte_coverage(path, ranks)

    bos, eos = _pick_bos_eos(path, specials)
    pat_str = _hf_pattern(data.get("pre_tokenizer"))
    return _make(path, ranks, specials, pat_str, bos, eos)


def _hf_pattern(pre_tokenizer: dict | None) -> str:
    """One tiktoken regex for a Hugging Face pre-tokenizer.

    The ``Split`` regexes of a ``Sequence`` are joined as an alternation in their order (DeepSeek-V3
    isolates digits, then CJK runs, then applies its main pattern; leftmost-first alternation
    splits such text the same way). ``ByteLevel`` with ``use_regex`` contributes GPT-2's regex.
    Without any of these, the default pattern is used.
    """
    if not pre_tokenizer:
        return DEFAULT_PAT_STR
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    patterns = []
    for step in steps or []:
        if step.get("type") == "Split":
            pattern = step.get("pattern") or {}
            if "Regex" in pattern:
                patterns.append(pattern["Regex"])
            elif "String" in pattern:
                patterns.append(re.escape(pattern["String"]))
        elif step.get("type") == "ByteLevel" and step.get("use_regex", True):
            patterns.append(_GPT2_PAT_STR)
    return "|".join(f"(?:{p})" for p in patterns) if patterns else DEFAULT_PAT_STR


def _pick_bos_eos(path: Path, specials: dict[str, int]) -> tuple[str, str]:
    """BOS/EOS names: from ``tokenizer_config.json`` next to ``path`` if present, else by known names."""
    config_path = path.with_name("tokenizer_config.json")
    configured: dict[str, str] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_bytes())
        except ValueError as e:
            raise ValueError(f"tokenizer config {str(config_path)!r} is not valid JSON: {e}") from None
        for key in ("bos_token", "eos_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value in specials:
                configured[key] = value

    def pick(key: str, candidates: tuple[str, ...]) -> str:
        if key in configured:
            return configured[key]
        for name in candidates:
            if name in specials:
                return name
        raise ValueError(
            f"tokenizer file {str(path)!r} has no recognisable {key} among its added tokens "
            f"(tried tokenizer_config.json and {', '.join(candidates)})"
        )

    return pick("bos_token", _BOS_CANDIDATES), pick("eos_token", _EOS_CANDIDATES)


def _check_byte_coverage(path: Path, ranks: dict[bytes, int]) -> None:
    """A byte-level BPE must map every single byte, or tiktoken cannot encode arbitrary text."""
    if not ranks:
        raise ValueError(f"tokenizer file {str(path)!r} holds no tokens")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"tokenizer file {str(path)!r} lacks {len(missing)} of the 256 single-byte tokens "
            f"(first: {missing[0]:#04x}); it is not a byte-level BPE"
        )


def _make(
    path: Path, ranks: dict[bytes, int], specials: dict[str, int], pat_str: str, bos: str, eos: str
) -> Tokenizer:
    """Build the Tokenizer, reporting tiktoken's complaints (id clashes, bad regex) against ``path``."""
    clash = set(ranks.values()) & set(specials.values())
    if clash:
        raise ValueError(f"tokenizer file {str(path)!r} gives id {min(clash)} to both a token and a special token")
    try:
        return Tokenizer(path.name, ranks, specials, pat_str, bos, eos)
    except ValueError as e:
        raise ValueError(f"tokenizer file {str(path)!r} cannot be used by tiktoken: {e}") from None
