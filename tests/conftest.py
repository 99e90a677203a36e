"""Shared test set-up: no network, no CUDA assumptions, the repo root importable and as working directory, the
root logger as each test found it, and a bounded disk footprint (every temporary file under one folder removed at
the end; a per-test budget)."""

import getpass
import logging
import multiprocessing.util
import os
import shutil
import sys
import tempfile

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Forced, not defaulted: a user's exported HF_HUB_OFFLINE=0 must not let a test reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


#: What one test may leave under its tmp_path when it ends. A CI run once failed on a full disk: every run left
#: 15-19 GB of debug-model checkpoints, and pytest keeps the folders of the last sessions.
DISK_BUDGET_BYTES = 1 << 30


def pytest_configure(config):
    """Send every temporary file of the session (test modules, worker processes, torchrun's torchelastic_* logs,
    which a killed launcher leaves behind) to one folder, removed in `pytest_unconfigure`."""
    # torch keeps its compile cache under the temporary folder; keep it where a user's runs keep it (a user
    # without a name, as in some containers, gets a cache per session instead).
    try:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    except (KeyError, OSError):
        pass
    # pytest-xdist workers (run_tests.sh runs two) share the cores: one thread each, in-process and in the
    # processes a test starts, or OpenMP's spinning threads of the two slow each other tenfold
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    config._session_tmp = tempfile.mkdtemp(prefix="trainer-tests-")
    os.environ["TMPDIR"] = config._session_tmp
    tempfile.tempdir = None


def pytest_unconfigure(config):
    """Remove the session's temporary folder (see `pytest_configure`) when the process exits, after
    multiprocessing's own exit cleanup: the fork server of tests/dist_utils.py keeps its socket's folder in it,
    which that cleanup removes (and fails on if it is gone)."""
    folder = getattr(config, "_session_tmp", None)
    if folder:
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                      exitpriority=-1000)


def _tree_bytes(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@pytest.fixture(autouse=True)
def _disk_budget(request):
    """Fail a test that leaves more than `DISK_BUDGET_BYTES` under its tmp_path (passing tests' folders are then
    removed: `tmp_path_retention_policy = "failed"` in pyproject.toml)."""
    # requested here, tmp_path is torn down (and removed) after this check, not before
    path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if path is None:
        return
    used = _tree_bytes(path)
    assert used <= DISK_BUDGET_BYTES, \
        f"the test left {used / 2**20:.0f} MiB under its tmp_path, over the {DISK_BUDGET_BYTES >> 20} MiB budget"


@pytest.fixture(scope="module")
def module_tmp_path(tmp_path_factory):
    """A folder shared by one module's tests, removed when the module ends (tmp_path_factory's would stay to the
    end of the session)."""
    folder = tmp_path_factory.mktemp("module")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


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


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that runs a trainer's or a benchmark's main in-process gets `init_logging`'s handler, bound to the
    stderr pytest captured for that test and closes after it: left on the root logger, every later test's log line
    became a "Logging error" traceback on its stderr. pytest's own capture handlers come and go per phase: kept."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers and not type(h).__module__.startswith("_pytest")]:
        root.removeHandler(handler)
    root.setLevel(level)
