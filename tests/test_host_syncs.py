"""The training loop waits for the device at most once per step, and not at all on a step that logs nothing.

On CPU there is no device to wait for, so the count is of what would wait on CUDA: every read of a tensor's value
into Python (`aten._local_scalar_dense`: `.item()`, `float()`, `bool()`, `int()` on a tensor) and every read of the
loop's pending values (`trainer.step_scalars.read_to_host`, one device-to-host copy). Reads of tensors that live on
the CPU by construction are not syncs on CUDA either, and the test names where they happen (the preemption flag:
a CPU tensor polled over gloo). The CUDA test in tests/test_cuda.py checks the same bound with torch's own sync
detector on a GPU.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.small_models import SMALL, hf_config_file
from trainer import step_scalars
from trainer.job_config import load_config
from trainer.train import Trainer, prepare

SYNC_WARNING = "called a synchronizing CUDA operation"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_OURS = tuple(os.path.join(REPO, d) for d in ("tests", ".venv"))
#: code whose scalar reads are of CPU tensors on every device (not syncs): file -> why
TORCH_OPTIM = "torch.optim"
HOST_TENSORS = {os.path.join("trainer", "preemption.py"): "the preemption flag is a CPU tensor reduced over gloo",
                TORCH_OPTIM: "torch's foreach and for-loop AdamW keep their step counters on the CPU (not capturable)"}


class _ScalarReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense` calls by the repository file that made them (the innermost frame of ours;
    a dispatch mode's `__torch_dispatch__`, such as the exact memory tracker's, passes the op on and is not it)."""

    def __init__(self):
        super().__init__()
        self.by_file, self.where = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()
            ours = [f"{os.path.relpath(f.filename, REPO)}:{f.lineno}" for f in stack
                    if f.filename.startswith(REPO) and not f.filename.startswith(_NOT_OURS)
                    and f.name != "__torch_dispatch__"]
            where = ours[-1] if ours else "torch"
            if any(os.sep.join(("torch", "optim", "")) in f.filename for f in stack):
                where = TORCH_OPTIM
            self.by_file[where.split(":")[0]] += 1
            self.where[where] += 1
        return func(*args, **(kwargs or {}))

    def device_reads(self) -> int:
        return sum(n for file, n in self.by_file.items() if file not in HOST_TENSORS)


class _CudaSyncs:
    """Counts torch's warnings for a synchronising CUDA operation (`torch.cuda.set_sync_debug_mode`); a read of the
    pending values (`read_to_host`) counts once, as on CPU."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self._caught = warnings.catch_warnings(record=True)
        self._warnings = self._caught.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._previous)
        self._caught.__exit__(*exc)

    def device_reads(self) -> int:
        return sum(SYNC_WARNING in str(w.message) for w in self._warnings)


def _reads_per_step(tmp_path, *overrides, device="cpu") -> tuple[dict[int, int], _ScalarReads, Trainer]:
    """Train SMALL in this process; the device reads of each step (from one step's batch to the next's)."""
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--model.hf_config_path", hf_config_file(SMALL), "--training.seq_len", "64",
                       "--training.local_batch_size", "2", "--training.steps", "7", "--metrics.log_freq", "3",
                       "--validation.freq", "6", "--metrics.enable_tensorboard", "false", *overrides])
    trainer = Trainer(prepare(cfg, 1, 0), torch.device(device))
    reads = _ScalarReads() if device == "cpu" else _CudaSyncs()
    marks: list[tuple[int, int]] = []
    advance = trainer._advance

    def mark(point, step=None, patience=0.0):
        if step is not None:  # the start of a step: "reading its batch"
            marks.append((step, reads.device_reads() + step_scalars.host_reads()))
        advance(point, step, patience)

    trainer._advance = mark
    try:
        with reads:
            trainer.train()
        marks.append((None, reads.device_reads() + step_scalars.host_reads()))
    finally:
        trainer.close()
    return {step: after - before for (step, before), (_, after) in zip(marks, marks[1:])}, reads, trainer


@pytest.mark.slow
def test_the_loop_reads_the_device_once_per_logging_step_and_never_otherwise(tmp_path):
    per_step, reads, _ = _reads_per_step(tmp_path / "skip")
    # logging steps: the first, every 3rd, the last; step 6 validates (its loss is read with the step's values)
    assert per_step == {1: 1, 2: 0, 3: 1, 4: 0, 5: 0, 6: 1, 7: 1}, (per_step, reads.where)
    assert set(reads.by_file) <= set(HOST_TENSORS), reads.where

    # on_nonfinite = stop must know every step's verdict: one read per step, still never more
    per_step, reads, _ = _reads_per_step(tmp_path / "stop", "--training.on_nonfinite", "stop")
    assert per_step == dict.fromkeys(range(1, 8), 1), (per_step, reads.where)

    # torch's foreach AdamW takes no device-side skip flag: the host reads the step's verdict before stepping, and
    # a logging step reads its values as well
    per_step, reads, trainer = _reads_per_step(tmp_path / "foreach", "--optimizer.implementation", "foreach")
    assert not trainer._skips_on_device
    assert per_step == {1: 2, 2: 1, 3: 2, 4: 1, 5: 1, 6: 2, 7: 2}, (per_step, reads.where)


@pytest.mark.cuda
def test_cuda_the_loop_waits_for_the_device_only_on_logging_steps(tmp_path):
    """The same bound on a GPU, from torch's own detector of synchronising CUDA operations: the loop's single read on a
    logging step (a device-to-host copy, which the detector counts as well) and nothing on the other steps; step 1
    (lazy state, cuBLAS handles) is left out."""
    torch.cuda.set_device(0)
    per_step, _, _ = _reads_per_step(tmp_path, "--training.dtype", "bfloat16", device="cuda")
    # a read is a host read plus the copy the detector sees: 2 on a logging step, 0 elsewhere
    assert {step: n for step, n in per_step.items() if step > 1} == {2: 0, 3: 2, 4: 0, 5: 0, 6: 2, 7: 2}, per_step


def test_a_failing_step_still_logs_the_steps_before_it(tmp_path):
    """Steps between logging steps wait in the loop unread; when a later step raises, they still reach `history`
    (and tensorboard) before the error propagates: here steps 1 and 3 are logging steps, 4 waits, 5 fails."""
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--model.hf_config_path", hf_config_file(SMALL), "--training.seq_len", "32",
                       "--training.local_batch_size", "1", "--training.steps", "7", "--metrics.log_freq", "3",
                       "--validation.enable", "false", "--metrics.enable_tensorboard", "false"])
    trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
    advance = trainer._advance

    def fail_at_step_5(point, step=None, patience=0.0):
        if step == 5:
            raise RuntimeError("step 5 failed")
        advance(point, step, patience)

    trainer._advance = fail_at_step_5
    history: list[dict] = []
    try:
        with pytest.raises(RuntimeError, match="step 5 failed"):
            trainer.train(history)
    finally:
        trainer.close()
    assert len(history) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history), history
