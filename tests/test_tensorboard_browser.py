"""Tensorboard as a user reads it, in a real browser (issue 36): three short runs (AC none, selective, full) in one
tb folder, tensorboard started on it, and its HParams, Time Series (filtered to the peak's cards) and Custom
Scalars pages loaded in headless Chromium (tests/chromium.py). The test checks what shows without a click beyond
choosing the tab: each run's AC mode and layout in the HParams table (columns shown by default), integers shown
as integers, the Trial ID starting with what differs; the memory cards and the Custom Scalars charts; and it saves
a screenshot of each page.

Skipped where the system's Chromium is missing (`apt-get install chromium`; `.ci/run` installs it). Run it with

    .venv/bin/python -m pytest tests/test_tensorboard_browser.py            # about 30-40 s on 2 cores
    TB_SCREENSHOTS=/tmp/shots .venv/bin/python -m pytest tests/test_tensorboard_browser.py   # keep the PNGs

and take the same screenshots of any runs (docs/memory.md's were taken so):

    .venv/bin/python tests/test_tensorboard_browser.py <logdir> <folder for the PNGs>
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests import chromium  # noqa: E402

pytestmark = pytest.mark.skipif(not chromium.available(),
                                reason=f"no Chromium at {chromium.CHROMIUM} (apt-get install chromium)")

TENSORBOARD = os.path.join(os.path.dirname(sys.executable), "tensorboard")
AC_MODES = ("none", "selective", "full")


@contextlib.contextmanager
def tensorboard(logdir: str, runs: int):
    """A tensorboard on `logdir` at a free local port, once it lists `runs` runs with scalars; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([TENSORBOARD, "--logdir", logdir, "--port", str(port), "--host", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=5) as reply:
                    if len(json.load(reply)) >= runs:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard did not serve {runs} runs: {process.stderr.read()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _hparams_table(page: chromium.Chromium) -> str | None:
    """The HParams table's text once every run's row is in."""
    text = page.text("tf-hparams-table-view")
    return text if text and len(re.findall(r"\bac=", text)) >= len(AC_MODES) else None


def shoot(url: str, out: str, all_pages: bool = True, width: int = 1600) -> dict[str, str]:
    """Load each page of tensorboard at `url` afresh in a `width` x 1000 window, wait for its data, save
    `out/tensorboard_<page>.png`; returns the text each page showed, by page. The three pages a user compares runs
    on, and with `all_pages` also the worst ranks (Text) and the experts' load (Time Series filtered to the
    image)."""
    os.makedirs(out, exist_ok=True)
    texts = {}

    def cards(tag: str):
        """The Time Series cards' titles (a tag's parts are separate texts there), once `tag`'s is among them."""
        js = ("[...new Set([...document.querySelectorAll('card-view tb-truncated-path')]"
              ".map(e => e.textContent.trim()))]")
        return lambda p: (titles := p.evaluate(js)) and tag in titles and " ".join(titles)

    with chromium.Chromium(width=width) as page:
        page.open(f"{url}/#hparams")
        texts["hparams"] = page.wait_for(_hparams_table, what="the HParams table")
        page.screenshot(os.path.join(out, "tensorboard_hparams.png"))

        page.open(f"{url}/?tagFilter=memory/peak_allocated_GiB/#timeseries")  # the filter, as typed into its box
        texts["timeseries_memory"] = page.wait_for(cards("memory/peak_allocated_GiB/max"), what="the memory cards")
        time.sleep(2)  # the charts' lines are drawn after their cards
        page.screenshot(os.path.join(out, "tensorboard_timeseries_memory.png"))

        page.open(f"{url}/#custom_scalars")
        texts["custom_scalars"] = page.wait_for(
            lambda p: (t := p.text("tf-custom-scalar-dashboard")) and "peak_allocated_GiB" in t and t,
            what="the Custom Scalars charts")
        time.sleep(2)
        page.screenshot(os.path.join(out, "tensorboard_custom_scalars.png"))
        if not all_pages:
            return texts

        page.open(f"{url}/#text")
        texts["text_worst_rank"] = page.wait_for(
            # every run's text: they load one by one
            lambda p: (t := p.text()) and t.count("memory/peak_allocated_GiB") >= len(AC_MODES) and t,
            what="the worst-rank texts")
        page.scroll_to("worst_rank")  # below the merged config
        page.screenshot(os.path.join(out, "tensorboard_text_worst_rank.png"))

        page.open(f"{url}/?tagFilter=tokens_per_expert#timeseries")
        texts["images_expert_load"] = page.wait_for(
            lambda p: p.evaluate("document.querySelectorAll('card-view img').length") >= 1 and cards(
                "moe/tokens_per_expert")(p), what="the experts' load image")
        time.sleep(1)
        page.screenshot(os.path.join(out, "tensorboard_images_expert_load.png"))
    return texts


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """Three 2-step runs of tests/small_models.py's TINY model in one tb folder, AC none, selective and full: the
    shared settings in a TOML file, the AC mode alone on the command line (as a user runs a comparison)."""
    from core.config import config_to_toml
    from tests.small_models import TINY, hf_config_file
    from trainer.job_config import load_config
    from trainer.train import run

    dump = tmp_path_factory.mktemp("tb_browser")
    shared = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(dump),
                          "--model.hf_config_path", hf_config_file(TINY, dump), "--training.seq_len", "32",
                          "--training.local_batch_size", "2", "--training.steps", "2", "--validation.enable",
                          "false", "--metrics.log_freq", "1"])
    config = dump / "shared.toml"
    config.write_text(config_to_toml(shared))
    for mode in AC_MODES:
        run(load_config(["--job.config_file", str(config), "--activation_checkpoint.mode", mode]))
    return str(dump / "tb")


def test_what_a_user_sees_without_clicking(three_runs, tmp_path):
    out = os.environ.get("TB_SCREENSHOTS") or str(tmp_path / "screenshots")
    with tensorboard(three_runs, runs=len(AC_MODES)) as url:
        texts = shoot(url, out)
    table = texts["hparams"]
    # the columns shown by default: the one that differs (ac_mode, and ac_save_ops with it), then the layout and
    # the dtype, before any other
    headers = re.search(r"Trial ID Show Metrics (.*?) run/", table)
    assert headers and headers.group(1).split()[:5] == ["ac_mode", "ac_save_ops", "layout", "dtype", "world_size"], \
        table
    for mode in AC_MODES:
        # each row: its Trial ID (the run folder's name) starts with its AC mode, then its AC mode, save ops, layout
        # and dtype, the world size as an integer
        assert re.search(rf"\bac={mode},1rank,fp32-\d{{8}}-\d{{6}} {mode} \S+ 1rank float32 1 ", table), (mode, table)
    assert not re.search(r"\b\d\.0000\b", table.split("run/")[0]), table  # no integer shown as a float
    cards = texts["timeseries_memory"]
    assert all(f"memory/peak_allocated_GiB/{s}" in cards for s in ("max", "median", "min")), cards
    assert "max_rank" not in cards  # a rank is no curve (the filter would show memory/peak_allocated_GiB/max_rank)
    charts = texts["custom_scalars"]
    assert "memory across ranks" in charts and all(c in charts for c in ("peak_allocated_GiB", "allocated_GiB"))
    worst = texts["text_worst_rank"]
    assert worst.count("memory/peak_allocated_GiB") >= len(AC_MODES) and "rank 0" in worst
    assert "moe/tokens_per_expert" in texts["images_expert_load"]
    names = [f"tensorboard_{p}.png" for p in ("hparams", "timeseries_memory", "custom_scalars", "text_worst_rank",
                                                "images_expert_load")]
    assert all(os.path.getsize(os.path.join(out, n)) > 10_000 for n in names)  # saved, and pages drawn, not blank


def main(argv: list[str]) -> None:
    """Screenshots of the runs of a logdir (the pages `shoot` loads), e.g. docs/memory.md's."""
    parser = argparse.ArgumentParser(description="Load tensorboard's pages for the runs of LOGDIR in headless "
                                                 "Chromium and save a screenshot of each in OUT.")
    parser.add_argument("logdir")
    parser.add_argument("out")
    parser.add_argument("--width", type=int, default=1600, help="the window's width in CSS pixels")
    args = parser.parse_args(argv)
    runs = len([d for d in os.listdir(args.logdir) if os.path.isdir(os.path.join(args.logdir, d))
                and d != "hparams_config"])
    with tensorboard(args.logdir, runs=runs) as url:
        for name in shoot(url, args.out, width=args.width):
            print(os.path.join(args.out, f"tensorboard_{name}.png"))


if __name__ == "__main__":
    main(sys.argv[1:])
