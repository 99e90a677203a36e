"""Shared test set-up: no network, no CUDA assumptions, the repo root importable and as working directory."""

import os
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Forced, not defaulted: a user's exported HF_HUB_OFFLINE=0 must not let a test reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run on a CUDA machine from the same command, and are skipped with a reason here."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run ./run_tests.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
