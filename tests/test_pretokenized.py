"""Pre-tokenized data: `python -m trainer.pretokenize` writes a job's token stream once; the loader that reads it
memory-mapped gives exactly the tokenizing loader's batches and state, and a folder that does not fit the job is
refused before launch."""

import os

# No test may reach the network; set before anything imports huggingface libraries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from small_models import TINY, hf_config_file

from core.config import run_with_config_errors
from trainer.data.loader import PackedDataLoader
from trainer.data.pretokenized import PretokenizedLoader, TokenStream, write_folder
from trainer.data.sources import ListDocuments
from trainer.job_config import load_config
from trainer.tokenizer import build_tokenizer
from trainer.tools.pretokenize import main as pretokenize

TOKENIZER = "assets/tokenizer/pydoc_bpe.tiktoken"
# Lengths from 2 tokens (an empty text: BOS and EOS) to a few hundred, so that sequences start and end anywhere in
# a document, and a batch may span several passes over the documents.
DOCS = ["", "a", *(f"Document {i}: " + "more words " * (i * 7 % 23) for i in range(30))]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TOKENIZER)


def _stream(tmp_path, tok, docs=DOCS, vocab_size=None) -> TokenStream:
    folder = tmp_path / f"tokens-{vocab_size}"
    identity = {"path": TOKENIZER, "sha256": "-", "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                "vocab_size": vocab_size or tok.vocab_size}
    encoded = (np.asarray(tok.encode(d, bos=True, eos=True), dtype=np.uint32) for d in docs)
    meta = write_folder(folder, identity, {"train": ({"dataset": "test"}, encoded)})
    return TokenStream(folder, "train", meta["splits"]["train"])


def _same_batch(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.next_batch(), b.next_batch()))


@pytest.mark.parametrize("vocab_size", [None, 1 << 17], ids=["uint16", "uint32"])
@pytest.mark.parametrize("seq_len,global_batch,dp", [(7, 4, 1), (7, 4, 2), (31, 6, 3), (600, 24, 4)])
def test_the_memory_mapped_loader_gives_the_tokenizing_loaders_batches_and_state(tmp_path, tok, vocab_size, seq_len,
                                                                                 global_batch, dp):
    """Every rank of every layout, over more than two passes of the documents (at 600 x 24 one batch spans more than
    one pass): the same inputs, labels and saved state at every step."""
    stream = _stream(tmp_path, tok, vocab_size=vocab_size)
    assert stream.tokens.dtype == np.dtype("<u2" if vocab_size is None else "<u4")
    assert stream.n_tokens < 600 * 24  # the last layout reads more than a pass per batch
    for rank in range(dp):
        packed = PackedDataLoader(ListDocuments(DOCS), tok, seq_len, global_batch, rank, dp)
        mapped = PretokenizedLoader(stream, seq_len, global_batch, rank, dp)
        assert mapped.state_dict() == packed.state_dict()
        for _ in range(2 * stream.n_tokens // (global_batch * (seq_len + 1)) + 2):
            assert _same_batch(packed, mapped)
            assert mapped.state_dict() == packed.state_dict()
    assert packed.epoch >= 2


def test_either_loader_resumes_the_others_state_on_another_layout(tmp_path, tok):
    """A state saved by one loader on 2 ranks continues in the other on 3 ranks with another global batch, as the
    straight run of the new layout would from the same sequence."""
    stream = _stream(tmp_path, tok)
    for saver, loader in ((PackedDataLoader, PretokenizedLoader), (PretokenizedLoader, PackedDataLoader)):
        first = saver(stream, 9, 4, 1, 2) if saver is PretokenizedLoader else saver(ListDocuments(DOCS), tok, 9, 4, 1,
                                                                                    2)
        for _ in range(7):
            first.next_batch()
        state = first.state_dict()
        for rank in range(3):
            resumed = loader(stream, 9, 6, rank, 3) if loader is PretokenizedLoader else loader(ListDocuments(DOCS),
                                                                                             tok, 9, 6, rank, 3)
            resumed.load_state_dict(state)
            reference = PackedDataLoader(ListDocuments(DOCS), tok, 9, 6, rank, 3)
            reference.load_state_dict(state)
            for _ in range(5):
                assert _same_batch(resumed, reference)


def test_a_state_saved_from_other_documents_is_refused(tmp_path, tok):
    stream = _stream(tmp_path, tok)
    other = PackedDataLoader(ListDocuments(["something else entirely"] * 3), tok, 5, 2, 0, 1)
    other.next_batch()
    with pytest.raises(ValueError, match=r"does not fit .*tokens-None \[train\]: it was saved from other documents"):
        PretokenizedLoader(stream, 5, 2, 0, 1).load_state_dict(other.state_dict())
    beyond = {"epoch": 0, "doc_index": len(DOCS) + 1, "sequences_consumed": 0, "buffer": []}
    with pytest.raises(ValueError, match="does not fit"):
        PretokenizedLoader(stream, 5, 2, 0, 1).load_state_dict(beyond)


def _corpus(tmp_path, docs, name="corpus.jsonl") -> Path:
    data = tmp_path / name
    data.write_text("".join(json.dumps(d if isinstance(d, dict) else {"text": d}) + "\n" for d in docs))
    return data


def _job(tmp_path, data, *extra) -> list[str]:
    return ["--job.config_file", "train_configs/debug_model.toml", "--dataset.path", str(data),
            "--training.seq_len", "16", "--training.local_batch_size", "2", "--validation.hold_out_every", "5",
            "--job.dump_folder", str(tmp_path / "dump"), *extra]


def _refused(argv, capsys, fn=pretokenize) -> str:
    """The one line a command ends with (exit code 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        run_with_config_errors(fn, argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_pretokenize_writes_the_jobs_splits_and_the_job_reads_the_same_batches(tmp_path, tok, capsys):
    """A local file with validation held out: the folder's splits hold the documents training and validation read
    (the same bytes with 1 or 2 workers), and the job's loaders built from it give the batches of the job's
    tokenizing loaders, training and validation, on both ranks of 2."""
    from trainer.train import prepare

    data = _corpus(tmp_path, DOCS)
    job = _job(tmp_path, data)
    summary = pretokenize([*job, "--output", str(tmp_path / "one"), "--workers", "1"])
    capsys.readouterr()
    pretokenize([*job, "--output", str(tmp_path / "two"), "--workers", "2"])
    assert json.loads(capsys.readouterr().out)["splits"] == summary["splits"]
    for name in ("train.tokens", "train.ends", "validation.tokens", "validation.ends", "meta.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert {name: split["documents"] for name, split in summary["splits"].items()} == {"train": 26, "validation": 6}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    for rank in range(2):
        text = prepare(load_config(job), world_size=2, rank=rank)
        mapped = prepare(load_config([*job, "--dataset.pretokenized", str(tmp_path / "one")]), world_size=2,
                         rank=rank)
        assert isinstance(mapped.train_loader, PretokenizedLoader)
        for _ in range(20):
            assert _same_batch(text.train_loader, mapped.train_loader)
        for _ in range(4):
            assert _same_batch(text.val_loader, mapped.val_loader)
    assert not (tmp_path / "dump").exists()


def test_pretokenize_refuses_in_one_line_and_leaves_nothing_behind(tmp_path, capsys):
    """Exit code 2, one line naming the key, and nothing new on disk (neither the folder, nor a partial one, nor the
    parents it made) for: no folder named, a bad --workers, a section check, an output that is a file, under a
    file, an existing folder without --force, a folder the command did not write (--force replaces only those), a
    document further in that lacks the text field. --force keeps the old folder whole when the new one fails."""
    data = _corpus(tmp_path, [*DOCS[:8], {"content": "no text field"}, *DOCS[8:]], "bad.jsonl")
    job = _job(tmp_path, data)
    assert _refused(job, capsys) == ("config error: --output: no folder to write: neither --output nor "
                                     "dataset.pretokenized is set; allowed: a folder path")
    out = tmp_path / "out"
    assert _refused([*job, "--output", str(out), "--workers", "x"], capsys) == (
        "config error: --workers: 'x'; allowed: a whole number, 1 or more")
    assert _refused([*job, "--output", str(out), "--dataset.name", "", "--dataset.path", ""], capsys) == (
        "config error: dataset.name: empty and dataset.path is empty too; allowed: a dataset name or a dataset.path")
    assert _refused([*job, "--output", str(data)], capsys) == (
        f"config error: --output: {data} is a link or a file; allowed: a new folder, or one this command wrote")
    assert _refused([*job, "--output", str(data / "x")], capsys) == (
        f"config error: --output: {data / 'x'} cannot be made: {data} is not a writable folder; allowed: a path under "
        "a writable folder")
    assert _refused([*job, "--output", ".", "--force"], capsys) == (  # the checkout, not deleted
        f"config error: --output: {Path.cwd()} is not a folder this command wrote (no meta.json): --force replaces only "
        "those; allowed: a new folder, or one this command wrote")
    line = _refused([*job, "--output", str(tmp_path / "a" / "b" / "out"), "--workers", "2"], capsys)
    assert line.startswith("config error: dataset.text_field: ") and line.endswith("bad.jsonl line 9 (document 8)")
    assert list(tmp_path.iterdir()) == [data]

    good = _corpus(tmp_path, DOCS)
    pretokenize([*_job(tmp_path, good, "--dataset.pretokenized", str(out)), "--workers", "1"])
    assert _refused([*job, "--output", str(out)], capsys) == (f"config error: --output: {out} exists; allowed: a new "
                                                             "folder, or --force to replace it")
    before = (out / "train.tokens").read_bytes()
    _refused([*job, "--output", str(out), "--force", "--workers", "1"], capsys)
    assert (out / "train.tokens").read_bytes() == before
    pretokenize([*_job(tmp_path, good, "--validation.enable", "false"), "--output", str(out), "--force",
                 "--workers", "1"])
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.ends", "train.tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "corpus.jsonl", "out"]


def test_a_folder_written_meanwhile_is_never_replaced_without_force(tmp_path, tok):
    """Two writers of one folder: the one that finishes second fails and leaves the first one's folder as it was."""
    folder = tmp_path / "tokens"
    identity = {"path": TOKENIZER, "sha256": "-", "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                "vocab_size": tok.vocab_size}

    def documents():
        yield np.asarray(tok.encode("first", bos=True, eos=True), dtype=np.uint32)
        folder.mkdir()
        (folder / "theirs.txt").write_text("the other writer's")
        yield np.asarray(tok.encode("second", bos=True, eos=True), dtype=np.uint32)

    with pytest.raises(FileExistsError, match="exists"):
        write_folder(folder, identity, {"train": ({}, documents())})
    assert [p.name for p in tmp_path.iterdir()] == ["tokens"] and [p.name for p in folder.iterdir()] == ["theirs.txt"]


def test_a_folder_that_does_not_fit_the_job_is_refused_before_launch(tmp_path, capsys):
    """Preflight ends with one line naming dataset.pretokenized for: no such folder, another tokenizer, other
    documents (another text field, no validation hold-out), no validation split, a truncated token file."""
    from trainer.tools.preflight import main as preflight

    data = _corpus(tmp_path, DOCS)
    out = tmp_path / "out"
    pretokenize([*_job(tmp_path, data, "--validation.enable", "false"), "--output", str(out), "--workers", "1"])
    capsys.readouterr()

    def refused(*extra) -> str:
        line = _refused(_job(tmp_path, data, "--dataset.pretokenized", str(out), *extra), capsys, preflight)
        assert line.startswith("config error: dataset.pretokenized: "), line
        assert line.endswith("allowed: a folder written for this job (`python -m trainer.pretokenize --job.config_file "
                             'train_configs/debug_model.toml [overrides] --force`), or "" to tokenize as training '
                             "reads"), line
        return line

    assert f"{out}'s train split was written from hold_out_every 0, this run's is 5" in refused()
    assert f"{out} has no validation split (it holds train)" in refused("--validation.dataset", str(data))
    # a folder with a local validation.dataset needs neither file at hand to train
    val = _corpus(tmp_path, DOCS[:5], "val.jsonl")
    with_val = _job(tmp_path, data, "--validation.dataset", str(val))
    pretokenize([*with_val, "--output", str(tmp_path / "with_val"), "--workers", "1"])
    capsys.readouterr()
    val.unlink()
    data.rename(tmp_path / "moved.jsonl")
    preflight([*with_val, "--dataset.pretokenized", str(tmp_path / "with_val")])
    (tmp_path / "moved.jsonl").rename(data)
    assert f"{out}'s train split was written from text_field 'text', this run's is 'body'" in refused(
        "--validation.enable", "false", "--dataset.text_field", "body")
    written = (out / "meta.json").read_text()
    meta = json.loads(written)
    meta["tokenizer"]["sha256"] = "0" * 64
    (out / "meta.json").write_text(json.dumps(meta))
    assert f"was written with the tokenizer {meta['tokenizer']['path']} (sha256 {'0' * 64}), this run's" in refused(
        "--validation.enable", "false")
    (out / "meta.json").write_text(written)
    with open(out / "train.tokens", "r+b") as f:
        f.truncate(100)
    assert "train.tokens holds 100 bytes, meta.json says" in refused("--validation.enable", "false")
    assert "not a folder written by `python -m trainer.pretokenize`" in refused(
        "--validation.enable", "false", "--dataset.pretokenized", str(tmp_path / "none"))


def test_training_resumes_across_the_two_loaders_and_refuses_a_folder_of_other_documents(tmp_path, capsys):
    """A tiny model on the shipped corpus: 2 steps from the pre-tokenized folder, saved, then resumed tokenizing as
    it reads, give the losses of 4 straight steps; a resume of that checkpoint from a folder of other documents is
    refused before launch, naming dataset.pretokenized."""
    from trainer.tools.preflight import main as preflight
    from trainer.train import Trainer, prepare

    pydoc = tmp_path / "pydoc"
    base = ["--job.config_file", "train_configs/debug_model.toml", "--model.hf_config_path",
            hf_config_file(TINY, tmp_path), "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--training.steps", "4", "--validation.enable", "false",
            "--memory.track", "off", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true",
            "--checkpoint.interval", "2"]
    pretokenize([*base, "--output", str(pydoc), "--workers", "1"])

    def train(dump: str, *extra) -> list[float]:
        trainer = Trainer(prepare(load_config([*base, "--job.dump_folder", str(tmp_path / dump), *extra]),
                                  world_size=1, rank=0), torch.device("cpu"))
        try:
            return trainer.train()
        finally:
            trainer.close()

    straight = train("straight")
    assert train("resumed", "--training.steps", "2", "--dataset.pretokenized", str(pydoc)) == straight[:2]
    assert train("resumed") == straight[2:]

    other = _corpus(tmp_path, DOCS)
    pretokenize([*base, "--dataset.path", str(other), "--output", str(tmp_path / "other"), "--workers", "1"])
    capsys.readouterr()
    line = _refused([*base, "--job.dump_folder", str(tmp_path / "resumed"), "--dataset.path", str(other),
                     "--dataset.pretokenized", str(tmp_path / "other")], capsys, preflight)
    assert line.startswith(f"config error: dataset.pretokenized: resuming {tmp_path / 'resumed'}/checkpoint/step-4: "
                           "data loader state (epoch 0, document "), line
    assert "does not fit" in line and line.endswith("allowed: the pre-tokenized folder of the documents and "
                                                    "tokenizer the checkpoint trained on"), line


def test_preflight_suggests_pre_tokenized_data_from_a_million_tokens_a_step(tmp_path, capsys):
    """Tokenizing as it reads with 4096 sequences of 257 tokens a step (1,052,672 tokens): preflight says so in one
    line with the command; 4080 sequences (1,048,560), or the same batch from a pre-tokenized folder: no line."""
    from trainer.tools.preflight import main as preflight

    base = ["--training.seq_len", "256", "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path)]
    preflight([*base, "--training.global_batch_size", "4096"])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "data: every rank tokenizes the whole global batch, 1,052,672 tokens a step (4096 sequences of 257), whatever "
        "the data-parallel degree; tokenize once (.venv/bin/python -m trainer.pretokenize [this job's config args] "
        "--output DIR) and train with --dataset.pretokenized DIR, so that each rank reads only its own sequences "
        "(docs/data.md#pre-tokenized-data)")
    preflight([*base, "--training.global_batch_size", "4080"])
    assert "tokenizes the whole global batch" not in capsys.readouterr().out
    pretokenize([*base, "--output", str(tmp_path / "pydoc"), "--workers", "1"])
    capsys.readouterr()
    preflight([*base, "--training.global_batch_size", "4096", "--dataset.pretokenized", str(tmp_path / "pydoc")])
    assert "tokenizes the whole global batch" not in capsys.readouterr().out
