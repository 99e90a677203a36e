"""What one rank's `next_batch` costs per step: tokenizing as it reads, against the pre-tokenized folder.

    .venv/bin/python benchmarks/data_loading.py [--seq-len 4096] [--global-batches 2 16 64] [--dp 1 8] [--steps 10]

The shipped corpus and tokenizer (`train_configs/debug_model.toml`'s data), written once with
`python -m trainer.pretokenize` into a temporary folder (its time is reported too). For each global batch and
data-parallel degree, the median over `--steps` of rank 0's `next_batch` with each loader, after one untimed call.
The tokenizing loader's time does not depend on the degree (every rank tokenizes the whole global batch), so it is
measured once per global batch. Prints one JSON object per row, then a summary with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import machine_info  # noqa: E402
from trainer.data.config import DatasetSection  # noqa: E402
from trainer.data.loader import build_dataloader  # noqa: E402
from trainer.data.pretokenized import PretokenizedLoader, TokenStream, read_meta  # noqa: E402
from trainer.tokenizer import build_tokenizer  # noqa: E402
from trainer.tools.pretokenize import main as pretokenize  # noqa: E402


def _median_ms(loader, steps: int) -> float:
    loader.next_batch()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loader.next_batch()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    """Measure and print the rows and the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batches", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    machine = machine_info()
    tokenizer = build_tokenizer("assets/tokenizer/pydoc_bpe.tiktoken")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pydoc"
        with contextlib.redirect_stdout(io.StringIO()):
            written = pretokenize(["--validation.enable", "false", "--output", str(folder), "--workers", "1"])
        stream = TokenStream(folder, "train", read_meta(folder)["splits"]["train"])
        for batch in args.global_batches:
            tokens = batch * (args.seq_len + 1)
            text_ms = _median_ms(build_dataloader(DatasetSection(), tokenizer, args.seq_len, batch, 0, 1), args.steps)
            for dp in (d for d in args.dp if batch % d == 0):
                mapped_ms = _median_ms(PretokenizedLoader(stream, args.seq_len, batch, 0, dp), args.steps)
                row = {"global_batch": batch, "seq_len": args.seq_len, "dp": dp, "tokenizing_ms": round(text_ms, 3),
                       "pretokenized_ms": round(mapped_ms, 4), "ratio": round(text_ms / mapped_ms, 1),
                       "tokenizing_tokens_per_s": round(tokens / text_ms * 1e3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"pretokenize": {"tokens": written["splits"]["train"]["tokens"], "seconds": written["seconds"],
                                      "tokens_per_s": written["tokens_per_s"]},
                      "rows": len(rows), "machine": machine}))


if __name__ == "__main__":
    main()
