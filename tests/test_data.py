"""Data: packing, layout-invariant global order, resume, epochs, local files via datasets, the corpus."""

import os

# No test may reach the network; set before anything imports huggingface libraries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""

import importlib.util
import json
import pickle
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.data.config import DatasetError, DatasetSection
from trainer.data.loader import PackedDataLoader, build_dataloader
from trainer.data.sources import HeldOutDocuments, ListDocuments, load_documents
from trainer.job_config import load_config
from core.loss import IGNORE_INDEX, count_valid_tokens
from trainer.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
DOCS = ["First document.", "Second one, a little longer than the first.", "3rd", "Fourth and last document here."]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("assets/tokenizer/pydoc_bpe.tiktoken")


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    """`datasets` with its cache in tmp and offline flags forced even if it was imported earlier."""
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    if hasattr(datasets_config, "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", True)


def _stream(tok, docs):
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def _loader(tok, docs, seq_len, gbs, rank=0, dp=1):
    return PackedDataLoader(ListDocuments(docs), tok, seq_len, gbs, rank, dp)


def _pydoc(split="train"):
    return SimpleNamespace(name="pydoc", path=None, split=split, streaming=False, text_field="text")


def test_packing_concatenates_documents_with_bos_eos_and_shifts_labels(tok):
    seq_len, gbs = 5, 2
    stream = _stream(tok, DOCS)
    loader = _loader(tok, DOCS, seq_len, gbs)
    n_steps = len(stream) // ((seq_len + 1) * gbs)
    assert n_steps >= 2
    for step in range(n_steps):
        inputs, labels = loader.next_batch()
        assert inputs.shape == labels.shape == (gbs, seq_len) and inputs.dtype == torch.long
        for row in range(gbs):
            start = (step * gbs + row) * (seq_len + 1)
            sequence = stream[start : start + seq_len + 1]
            assert inputs[row].tolist() == sequence[:-1]
            assert labels[row].tolist() == sequence[1:]
    # An EOS is followed by the next document's BOS inside the packed stream.
    eos_at = stream.index(tok.eos_id)
    assert stream[eos_at + 1] == tok.bos_id


def test_dp_slices_and_microbatches_form_the_global_batch(tok):
    docs = [json.loads(line)["text"] for line in (REPO / "assets/data/pydoc_corpus_val.jsonl").read_text().splitlines()]
    seq_len, gbs, steps = 16, 8, 4
    for dp in (2, 4):
        ranks = [_loader(tok, docs, seq_len, gbs, r, dp) for r in range(dp)]
        reference = _loader(tok, docs, seq_len, gbs)
        for _ in range(steps):
            want_inputs, want_labels = reference.next_batch()
            parts = [loader.next_batch() for loader in ranks]
            assert all(p[0].shape == (gbs // dp, seq_len) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), want_inputs)
            assert torch.equal(torch.cat([p[1] for p in parts]), want_labels)
            # Gradient accumulation: each rank splits its slice into microbatches in order.
            microbatches = [mb for p in parts for mb in p[0].split(1)]
            assert torch.equal(torch.cat(microbatches), want_inputs)


@pytest.mark.parametrize("resume_dp", [1, 2, 4])
def test_resume_yields_the_uninterrupted_batches(tok, resume_dp):
    docs = DOCS * 3
    seq_len, gbs, total, k = 7, 4, 9, 4
    straight = _loader(tok, docs, seq_len, gbs)
    expected = [straight.next_batch() for _ in range(total)]
    assert straight.epoch >= 1  # the run crosses an epoch boundary

    first = _loader(tok, docs, seq_len, gbs, rank=0, dp=2)
    for _ in range(k):
        first.next_batch()
    # The state is plain data: survives pickling (torch.save) and JSON.
    state = json.loads(json.dumps(pickle.loads(pickle.dumps(first.state_dict()))))
    assert state["sequences_consumed"] == k * gbs

    resumed = [_loader(tok, docs, seq_len, gbs, r, resume_dp) for r in range(resume_dp)]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(k, total):
        parts = [loader.next_batch() for loader in resumed]
        assert torch.equal(torch.cat([p[0] for p in parts]), expected[step][0])
        assert torch.equal(torch.cat([p[1] for p in parts]), expected[step][1])
    assert resumed[0].state_dict() == straight.state_dict()


def test_epoch_wrap_continues_the_stream(tok):
    seq_len, gbs = 3, 1
    loader = _loader(tok, DOCS, seq_len, gbs)
    stream = _stream(tok, DOCS)
    n = 3 * len(stream) // (seq_len + 1)
    got = []
    for _ in range(n):
        inputs, labels = loader.next_batch()
        got += inputs[0].tolist() + labels[0, -1:].tolist()
    assert got == (stream * 3)[: len(got)]
    assert loader.epoch == 2


def test_loader_argument_and_state_errors(tok):
    with pytest.raises(ValueError, match="not divisible"):
        _loader(tok, DOCS, 4, 6, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        _loader(tok, DOCS, 4, 4, 2, 2)
    with pytest.raises(ValueError, match="no documents"):
        _loader(tok, [], 4, 2).next_batch()
    with pytest.raises(ValueError, match="lacks buffer"):
        _loader(tok, DOCS, 4, 2).load_state_dict({"epoch": 0, "doc_index": 0, "sequences_consumed": 0})


def test_count_valid_tokens():
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 5]])
    assert count_valid_tokens(labels) == 3
    assert count_valid_tokens(torch.ones(2, 4, dtype=torch.long)) == 8


def test_pydoc_train_and_validation_splits(tok):
    train = build_dataloader(_pydoc(), tok, seq_len=32, global_batch_size=4, dp_rank=1, dp_degree=2)
    val = build_dataloader(_pydoc(), tok, 32, 4, 0, 1, split_override="validation")
    inputs, labels = train.next_batch()
    assert inputs.shape == (2, 32) and count_valid_tokens(labels) == 64
    assert val.next_batch()[0][0, 0] == tok.bos_id
    assert len(train.source.texts) > 300 and 10 <= len(val.source.texts) < 30
    with pytest.raises(ValueError, match="not 'test'"):
        build_dataloader(_pydoc("test"), tok, 32, 4, 0, 1)


def test_missing_local_path(tok):
    cfg = SimpleNamespace(name="pydoc", path="no/such/data.jsonl", split="train", streaming=False, text_field="text")
    with pytest.raises(ValueError, match=r"dataset path 'no/such/data.jsonl' not found") as err:
        build_dataloader(cfg, tok, 8, 2, 0, 1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("streaming", [True, False])
def test_local_jsonl_through_datasets_matches_builtin(tok, offline_datasets, streaming, tmp_path):
    seq_len, gbs = 64, 4
    builtin = build_dataloader(_pydoc("validation"), tok, seq_len, gbs, 0, 1)
    cfg = SimpleNamespace(name="ignored", path="assets/data/pydoc_corpus_val.jsonl", split="train",
                          streaming=streaming, text_field="text")
    local = build_dataloader(cfg, tok, seq_len, gbs, 0, 1)
    for _ in range(3):
        a, b = builtin.next_batch(), local.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Resume in the middle of the file goes through dataset.skip().
    resumed = build_dataloader(cfg, tok, seq_len, gbs, 1, 2)
    resumed.load_state_dict(local.state_dict())
    assert resumed.doc_index > 0
    assert torch.equal(resumed.next_batch()[0], builtin.next_batch()[0][gbs // 2 :])


def test_local_txt_dir_and_custom_field(tok, offline_datasets, tmp_path):
    text_file = tmp_path / "notes.txt"
    text_file.write_text("Alpha paragraph\nstill alpha.\n\nBeta paragraph.\n", encoding="utf-8")
    cfg = SimpleNamespace(name="x", path=str(text_file), split="train", streaming=True, text_field="text")
    loader = build_dataloader(cfg, tok, 4, 1, 0, 1)
    assert list(loader.source.iter_texts(0)) == ["Alpha paragraph\nstill alpha.", "Beta paragraph.\n"]

    data_dir = tmp_path / "shards"
    data_dir.mkdir()
    for i, body in enumerate(["one", "two", "three"]):
        (data_dir / f"part-{i}.jsonl").write_text(json.dumps({"body": body}) + "\n")
    cfg = SimpleNamespace(name="x", path=str(data_dir), split="train", streaming=True, text_field="body")
    loader = build_dataloader(cfg, tok, 4, 1, 0, 1)
    assert list(loader.source.iter_texts(1)) == ["two", "three"]
    loader.source.text_field = "missing"
    with pytest.raises(ValueError, match="no string field 'missing'"):
        list(loader.source.iter_texts(0))

    (data_dir / "extra.txt").write_text("mixed")
    with pytest.raises(ValueError, match="mixes file types"):
        build_dataloader(cfg, tok, 4, 1, 0, 1)


def test_unreadable_or_wrong_field_local_file_is_a_dataset_error(tok, offline_datasets, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"content": "a", "id": 1}) + "\n")
    cfg = SimpleNamespace(name="x", path=str(data), split="train", streaming=True, text_field="text")
    with pytest.raises(DatasetError, match=r"no string field 'text' \(its fields: content, id\)") as err:
        list(load_documents(cfg, "train").iter_texts(0))
    assert err.value.key == "text_field" and err.value.allowed == "a string field the documents have: content"

    # a later document without the field is named by its file line too (blank lines hold no document)
    data.write_text("\n".join([json.dumps({"text": "a"}), "", json.dumps({"text": "b"}), json.dumps({"body": "c"})]))
    for streaming in (True, False):
        cfg.streaming = streaming
        with pytest.raises(DatasetError) as err:
            list(load_documents(cfg, "train").iter_texts(0))
        assert err.value.problem == f"{data} [train]: {data} line 4 (document 2) has no string field 'text' (its " \
                                    "fields: body)"
        assert err.value.allowed.endswith(f"fix or remove {data} line 4 (document 2)")

    data.write_text(json.dumps({"text": "fine"}) + "\n{\"text\": broken\n")
    for streaming in (True, False):
        cfg.streaming = streaming
        # the row in the file and the document, whether the library parses at load time or while streaming
        with pytest.raises(DatasetError, match=r"data.jsonl line 2 \(document 1\) is not valid JSON") as err:
            list(load_documents(cfg, "train").iter_texts(0))
        assert err.value.key == "path"


def test_unknown_name_says_offline_and_did_you_mean(offline_datasets):
    # The test process is offline (conftest): with downloads allowed the environment is what keeps it offline.
    for allow_download, why in [(False, "downloads are off"), (True, "offline mode is on (HF_HUB_OFFLINE")]:
        cfg = DatasetSection(name="pydocs", allow_download=allow_download)
        with pytest.raises(DatasetError, match=r"'pydocs' is neither a local dataset") as err:
            load_documents(cfg, "train")
        assert err.value.key == "name" and why in err.value.problem and "did you mean 'pydoc'?" in err.value.problem
        assert "dataset.allow_download = true" in err.value.allowed


class _FakeHub:
    """A local HTTP server standing in for the Hugging Face Hub: answers 404 to everything, records the requests."""

    def __init__(self):
        import http.server
        import threading

        requests = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _not_found(self):
                requests.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_POST = _not_found

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.mark.slow
def test_allow_download_decides_whether_the_hub_is_asked(tmp_path):
    """In a fresh process with no HF offline variables (as run_train.sh starts the trainer): the default stays
    offline and asks nothing; dataset.allow_download = true asks the Hub (here a local stand-in)."""
    hub = _FakeHub()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(REPO))
    script = ("import sys; from trainer.data.config import DatasetSection\n"
              "from trainer.data.sources import load_documents\n"
              "try: load_documents(DatasetSection(name='no-such/dataset', allow_download=sys.argv[1] == 'true'),"
              " 'train')\nexcept ValueError as e: print(e)")
    try:
        for allow_download, expect, asked in [("false", "downloads are off", False),
                                              ("true", "the Hugging Face Hub does not serve it", True)]:
            before = len(hub.requests)
            done = subprocess.run([sys.executable, "-c", script, allow_download], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)
            assert expect in done.stdout, done.stdout + done.stderr
            assert (len(hub.requests) > before) == asked, hub.requests
    finally:
        hub.server.shutdown()


def test_held_out_documents_partition_the_source_and_resume_by_index():
    docs = [f"doc {i}" for i in range(60)]
    held = HeldOutDocuments(ListDocuments(docs), 25, held_out=True)
    rest = HeldOutDocuments(ListDocuments(docs), 25, held_out=False)
    want_held = [docs[i] for i in range(len(docs)) if i % 25 == 24]  # the 25th and the 50th
    assert list(held.iter_texts(0)) == want_held == ["doc 24", "doc 49"]
    assert list(rest.iter_texts(0)) == [d for d in docs if d not in want_held]
    for part in (held, rest):
        full = list(part.iter_texts(0))
        assert all(list(part.iter_texts(start)) == full[start:] for start in range(len(full) + 1))
    assert list(HeldOutDocuments(ListDocuments(docs[:24]), 25, held_out=True).iter_texts(0)) == []


@pytest.mark.parametrize("streaming", [True, False])
def test_single_local_file_holds_out_validation_documents(tok, offline_datasets, tmp_path, streaming):
    """`--dataset.path FILE` with the default config (validation on): validation reads every 25th document,
    training all the others, and the two never share a document."""
    from trainer.train import prepare

    docs = [f"Document {i}: " + "word " * (i % 7) for i in range(80)]
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--dataset.path", str(data),
                       "--dataset.streaming", str(streaming).lower(), "--training.seq_len", "16",
                       "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "dump")])
    prep = prepare(cfg, world_size=1, rank=0)
    train_docs = list(prep.train_loader.source.iter_texts(0))
    val_docs = list(prep.val_loader.source.iter_texts(0))
    assert val_docs == [d for i, d in enumerate(docs) if i % 25 == 24]
    assert not set(train_docs) & set(val_docs) and sorted(train_docs + val_docs) == sorted(docs)
    # The packed validation batches are those of the held-out documents.
    reference = PackedDataLoader(ListDocuments(val_docs), tok, 16, 2, 0, 1)
    for _ in range(3):
        got, want = prep.val_loader.next_batch(), reference.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not (tmp_path / "dump").exists()

    # Without validation, training reads every document; a local validation.dataset is read whole.
    other = tmp_path / "val.jsonl"
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:5]))
    cfg.validation.dataset = str(other)
    prep = prepare(cfg, world_size=1, rank=0)
    assert list(prep.train_loader.source.iter_texts(0)) == docs
    assert list(prep.val_loader.source.iter_texts(0)) == docs[:5]
    cfg.validation.enable = False
    assert list(prepare(cfg, world_size=1, rank=0).train_loader.source.iter_texts(0)) == docs


def test_corpus_generation_is_deterministic(tmp_path):
    tool = REPO / "tools" / "make_corpus.py"
    spec = importlib.util.spec_from_file_location("make_corpus", tool)
    make_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_corpus)
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([sys.executable, str(tool), "--out-dir", str(out)], check=True, capture_output=True)
        outputs.append([(out / name).read_bytes() for name in (make_corpus.TRAIN_FILE, make_corpus.VAL_FILE)])
    assert outputs[0] == outputs[1]
    train_lines = outputs[0][0].decode().splitlines()
    val_lines = outputs[0][1].decode().splitlines()
    assert 300 <= len(train_lines) and 0.03 <= len(val_lines) / (len(train_lines) + len(val_lines)) <= 0.05
    assert all(len(json.loads(line)["text"]) <= 2000 for line in train_lines + val_lines)
    if platform.python_version() == make_corpus.REFERENCE_PYTHON:
        committed = REPO / "assets" / "data"
        assert outputs[0] == [(committed / make_corpus.TRAIN_FILE).read_bytes(),
                              (committed / make_corpus.VAL_FILE).read_bytes()]


def test_an_empty_local_file_or_folder_is_one_line_streaming_or_not(tmp_path, offline_datasets, capsys):
    """An empty `.jsonl` as dataset.path, alone or inside a folder, streaming or not, and an empty `.txt`: the
    preflight ends with the same one line naming the path and 'no documents' (the datasets library's JSON reader
    raised StopIteration through a 38-line traceback)."""
    from core.config import run_with_config_errors
    from trainer.tools.preflight import main as preflight

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "part-0.jsonl").write_text("")
    (tmp_path / "folder" / "part-1.jsonl").write_text("\n  \n")
    (tmp_path / "empty.txt").write_text("")
    for path in (tmp_path / "empty.jsonl", tmp_path / "folder", tmp_path / "empty.txt"):
        for streaming in ("true", "false"):
            with pytest.raises(SystemExit) as exc:
                run_with_config_errors(preflight, [
                    "--job.config_file", "train_configs/debug_model.toml", "--validation.enable", "false",
                    "--job.dump_folder", str(tmp_path / "dump"), "--dataset.path", str(path),
                    "--dataset.streaming", streaming])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and err == f"config error: dataset.path: {path} [train]: no documents\n", err
    assert not (tmp_path / "dump").exists()
