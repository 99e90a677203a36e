"""Tokenizer: the shipped rank file, rank-file parsing and errors, tokenizer.json conversion, BPE training."""

import os

# No test may reach the network; set before anything imports tiktoken or huggingface libraries.
os.environ["TIKTOKEN_CACHE_DIR"] = ""
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import collections
import importlib.util
import json
from pathlib import Path

import pytest

from trainer.tokenizer import BOS_TOKEN, EOS_TOKEN, build_tokenizer, bytes_to_unicode

REPO = Path(__file__).resolve().parents[1]
SHIPPED = "assets/tokenizer/pydoc_bpe.tiktoken"
CORPUS = REPO / "assets/data/pydoc_corpus.jsonl"
VAL_CORPUS = REPO / "assets/data/pydoc_corpus_val.jsonl"


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _texts(path):
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(SHIPPED)


@pytest.fixture(scope="module")
def train_bpe():
    return _load_tool("train_bpe")


def test_shipped_vocab_and_special_ids(tok):
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (2046, 2047)
    ids = tok.encode("Hello world", bos=True, eos=True)
    assert ids[0] == 2046 and ids[-1] == 2047
    assert all(i < 2046 for i in ids[1:-1])
    assert tok.decode(ids[1:-1]) == "Hello world"


def test_round_trip_on_corpus(tok):
    texts = _texts(CORPUS) + _texts(VAL_CORPUS)
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    # Non-ASCII and unseen characters fall back to bytes and still round-trip.
    odd = "naïve café — 東京 🚀 \t\r\n  x"
    assert tok.decode(tok.encode(odd)) == odd
    # The BPE compresses its own training text well (about 3.6 bytes per token).
    sample = "".join(texts[:50])
    assert len(sample.encode()) / len(tok.encode(sample)) > 3.0


def test_special_strings_in_text_are_plain_text(tok):
    ids = tok.encode(f"a {BOS_TOKEN} b {EOS_TOKEN}")
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == f"a {BOS_TOKEN} b {EOS_TOKEN}"


def test_decode_accepts_tensors(tok):
    torch = pytest.importorskip("torch")
    ids = tok.encode("tensor input")
    assert tok.decode(torch.tensor(ids)) == "tensor input"


def test_relative_path_resolves_against_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert build_tokenizer(SHIPPED).vocab_size == 2048


def test_shipped_file_is_reproducible(train_bpe, tmp_path):
    counts = train_bpe.count_words(train_bpe.read_texts(CORPUS))
    out = tmp_path / "retrained.tiktoken"
    train_bpe.write_rank_file(out, train_bpe.train_bpe(counts, 2046))
    assert out.read_bytes() == (REPO / SHIPPED).read_bytes()


def test_trainer_matches_naive_bpe(train_bpe):
    """The incremental trainer learns exactly the merges of the textbook recount-everything loop."""
    counts = train_bpe.count_words(_texts(CORPUS)[:20])
    fast = train_bpe.train_bpe(counts, 330)

    vocab = [bytes([b]) for b in range(256)]
    ids = {t: i for i, t in enumerate(vocab)}
    words, freqs = [list(w) for w in counts], list(counts.values())
    while len(vocab) < 330:
        pairs = collections.Counter()
        for symbols, freq in zip(words, freqs):
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += freq
        a, b = min(pairs, key=lambda p: (-pairs[p], vocab[p[0]], vocab[p[1]]))
        merged = vocab[a] + vocab[b]
        if merged not in ids:
            ids[merged] = len(vocab)
            vocab.append(merged)
        words = [train_bpe._merge_word(s, a, b, ids[merged]) for s in words]
    assert fast == vocab


def test_rank_file_rewritten_in_place_is_reread(train_bpe, tmp_path):
    counts = train_bpe.count_words(_texts(CORPUS)[:30])
    path = tmp_path / "small.tiktoken"
    train_bpe.write_rank_file(path, train_bpe.train_bpe(counts, 400))
    first = build_tokenizer(str(path))
    assert (first.vocab_size, first.bos_id, first.eos_id) == (402, 400, 401)
    train_bpe.write_rank_file(path, train_bpe.train_bpe(counts, 300))
    second = build_tokenizer(str(path))
    assert (second.vocab_size, second.bos_id, second.eos_id) == (302, 300, 301)
    text = _texts(CORPUS)[0]
    assert second.decode(second.encode(text)) == text
    assert len(second.encode(text)) > len(first.encode(text))


def _write_bytes_only(path, extra_lines=""):
    import base64

    lines = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    path.write_text(lines + extra_lines)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("", "holds no tokens"),
        ("not base64!! 0\n", "corrupt at line 1"),
        ("QQ== zero\n", "corrupt at line 1"),
        ("QQ== 0 extra\n", "corrupt at line 1"),
        ("QQ== 0\nQg== 1\n", "lacks 254 of the 256 single-byte tokens"),
        (None, "corrupt at line 257: duplicate"),
    ],
)
def test_corrupt_rank_file(tmp_path, content, problem):
    path = tmp_path / "bad.tiktoken"
    if content is None:
        _write_bytes_only(path, "QUI= 5\n")  # rank 5 is taken by byte 0x05
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        build_tokenizer(str(path))
    message = str(err.value)
    assert problem in message and str(path) in message and "\n" not in message


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match=r"'no/such/file.tiktoken' not found") as err:
        build_tokenizer("no/such/file.tiktoken")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot be read"):
        build_tokenizer(str(tmp_path))  # a directory
    with pytest.raises(ValueError, match="not found"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


# --- Hugging Face tokenizer.json -------------------------------------------------------------

_MERGES = [("h", "e"), ("l", "l"), ("Ġ", "t"), ("Ġt", "he"), ("he", "ll"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or")]
_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]


def _write_hf_tokenizer(directory, with_config, bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"):
    """A DeepSeek-shaped byte-level BPE: specials at ids 0-2 (also listed in the vocab), then the
    256 byte symbols, then merges in order, and a Sequence pre-tokenizer with a Split regex."""
    alphabet = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(_SPECIALS)}
    for b in range(256):
        vocab[alphabet[b]] = len(vocab)
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": True, "special": True}
            for i, s in enumerate(_SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [f"{a} {b}" for a, b in _MERGES]},
    }
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    if with_config:
        config = {"bos_token": {"content": bos, "__type": "AddedToken"}, "eos_token": eos}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return path, vocab


@pytest.mark.parametrize("with_config", [True, False])
def test_hf_tokenizer_json(tmp_path, with_config):
    path, vocab = _write_hf_tokenizer(tmp_path, with_config)
    tok = build_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size == len(vocab)
    text = "hello the world 12345 ünïcödé\n\n  tabs\t"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 0 and ids[-1] == 1
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode("hell the wor") == [vocab["hell"], vocab["Ġthe"], vocab["Ġwor"]]
    # Digits are isolated in groups of at most three by the Split step.
    assert tok.decode(tok.encode("12345")) == "12345"
    assert [tok.decode([i]) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]


def test_hf_tokenizer_json_matches_tokenizers_library(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    path, _ = _write_hf_tokenizer(tmp_path, with_config=False)
    reference = tokenizers.Tokenizer.from_file(str(path))
    tok = build_tokenizer(str(path))
    for text in ["hello the world", "hell hello the the wor world 12345", " the  there\n\nthe"]:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_hf_tokenizer_config_choice_wins(tmp_path):
    path, _ = _write_hf_tokenizer(tmp_path, True, bos="<｜▁pad▁｜>", eos="<｜▁pad▁｜>")
    tok = build_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (2, 2)


def test_hf_tokenizer_json_errors(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(path))
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"▁hello": 0}}}))
    with pytest.raises(ValueError, match="outside the GPT-2 byte-level alphabet"):
        build_tokenizer(str(path))
    path.write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}))
    with pytest.raises(ValueError, match="only byte-level BPE"):
        build_tokenizer(str(path))
    hf_path, _ = _write_hf_tokenizer(tmp_path, with_config=False)
    data = json.loads(hf_path.read_text(encoding="utf-8"))
    data["added_tokens"] = []
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if k not in _SPECIALS}
    hf_path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no recognisable bos_token") as err:
        build_tokenizer(str(hf_path))
    assert "\n" not in str(err.value)
