"""Faults of a real cluster on gloo ranks: preemption signals, a stopped rank, a damaged checkpoint, a full disk.

Each fault is survived with nothing lost beyond the current step: a preempted run saves its last finished step and
the same command continues to the same final loss, bit for bit; a stopped rank ends the job with one line naming
it; a damaged checkpoint is skipped by an unattended restart; a failed save leaves the previous checkpoint the
latest. This file is also the torchrun worker of the in-process cases (`python tests/test_cluster_faults.py
jobs.json out.json` under torchrun).
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ARGS = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "1", "--training.deterministic", "true",
        "--memory.track", "off", "--validation.enable", "false", "--metrics.log_freq", "1"]


def _final_losses(dump) -> dict[int, float]:
    """step -> loss over every tensorboard run of a dump folder (a resumed run continues the steps)."""
    from trainer.metrics import read_scalars, run_dirs

    losses = {}
    for run in run_dirs(os.path.join(dump, "tb")):
        losses.update(dict(read_scalars(run)["loss"]))
    return losses


class _Launch:
    """`./run_train.sh` in the background, its stderr read line by line (the log and the error lines)."""

    def __init__(self, dump, *args, ngpu: int = 2):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["./run_train.sh", *ARGS, "--job.dump_folder", str(dump), *args], cwd=REPO,
                                     env=dict(os.environ, NGPU=str(ngpu)), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines[-30:])
            assert time.monotonic() < deadline, "\n".join(self.lines[-30:])
            time.sleep(0.2)

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def _children(pid: int) -> dict[int, int]:
    """rank -> pid of the ranks torchrun started under launcher `pid`."""
    ranks = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError):
            continue
        if parent == pid and b"RANK" in env:
            ranks[int(env[b"RANK"])] = int(entry)
    return ranks


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_the_step_and_the_same_command_resumes_exactly(tmp_path):
    """2 ranks, checkpoint.enable false: SIGTERM to the process a scheduler signals (run_train.sh, which execs the
    launcher) during training; exit 75 with a checkpoint of the last finished step; the same command then ends
    with the losses of a run that was never stopped, bit for bit."""
    steps = ["--training.steps", "6"]
    reference = _Launch(tmp_path / "reference", *steps)
    assert reference.finish() == 0, "\n".join(reference.lines[-20:])

    stopped = _Launch(tmp_path / "run", *steps)
    stopped.wait_for(r"INFO step    3 ")
    signalled = time.monotonic()
    stopped.proc.send_signal(signal.SIGTERM)
    assert stopped.finish() == 75, "\n".join(stopped.lines[-20:])
    took = time.monotonic() - signalled
    last = stopped.lines[-1]
    saved = int(re.search(r"checkpoint of step (\d+) saved", last).group(1))
    assert last.startswith("preempted by SIGTERM") and "the same command resumes" in last, last
    assert 3 <= saved < 6 and took < 60, (saved, took)
    assert (tmp_path / "run" / "checkpoint" / f"step-{saved}" / "PREEMPTED").is_file()
    assert not any("Traceback" in line for line in stopped.lines)

    resumed = _Launch(tmp_path / "run", *steps)
    assert resumed.finish() == 0, "\n".join(resumed.lines[-20:])
    assert any(f"resumed from {tmp_path / 'run' / 'checkpoint' / f'step-{saved}'}" in line for line in resumed.lines)
    assert _final_losses(tmp_path / "run") == _final_losses(tmp_path / "reference")


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_with_one_line_naming_it(tmp_path):
    """kill -STOP on rank 1 after step 3 with a 10 s train timeout: rank 0's watchdog names rank 1 and the step,
    the job ends within the timeout plus torchrun's 30 s teardown, and no process of it is left."""
    launch = _Launch(tmp_path / "run", "--training.steps", "1000", "--comm.train_timeout_seconds", "10",
                     "--metrics.enable_tensorboard", "false")
    launch.wait_for(r"INFO step    3 ")
    ranks = _children(launch.proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = launch.finish(timeout=120)
    took = time.monotonic() - stopped_at
    assert code == 1, "\n".join(launch.lines[-20:])
    last = launch.lines[-1]
    assert "run failed on rank 0" in last and "rank 1 (in step" in last and "stopped making progress" in last, last
    # 10 s of silence, up to 1 s until the watchdog looks, 30 s until torchrun kills the stopped rank
    assert took < 10 + 1 + 30 + 15, took
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks.values())
    assert not any("Traceback" in line for line in launch.lines)


# ----------------------------------------------------------------------------------------------- one process

@pytest.mark.slow
def test_damaged_latest_checkpoint_is_skipped_and_a_named_one_refused(tmp_path, caplog):
    from trainer.checkpoint import latest_checkpoint
    from trainer.config import ConfigError
    from trainer.job_config import load_config
    from trainer.train import prepare, run

    base = ["--job.config_file", "train_configs/debug_model.toml", *ARGS, "--job.dump_folder", str(tmp_path),
            "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false"]
    run(load_config(base + ["--training.steps", "2"]))
    step2 = tmp_path / "checkpoint" / "step-2"
    shard = sorted(step2.glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(100)
    cfg = load_config(base + ["--training.steps", "3"])
    with caplog.at_level("WARNING", logger="trainer"):
        assert latest_checkpoint(cfg.checkpoint, str(tmp_path), report_skipped=True) == str(
            tmp_path / "checkpoint" / "step-1")
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"step-2 (is truncated: {shard.name} is missing or too short)" in warning and "step-1" in warning
    with pytest.raises(ConfigError, match=f"is truncated: {shard.name}"):
        prepare(load_config(base + ["--training.steps", "3", "--checkpoint.load_step", "2"]), 1, 0)
    history: list[dict] = []
    run(cfg, history=history)
    assert len(history) == 2  # steps 2 and 3, resumed from step 1


# ----------------------------------------------------------------------------------------------- 2 ranks, in-process

VAL = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "3",
       "--metrics.enable_tensorboard", "false"]


@pytest.mark.slow
def test_sigterm_to_one_rank_during_validation_and_a_full_disk_on_one_rank(tmp_path):
    """One launch of 2 ranks:
    - SIGTERM to rank 1 only, in the validation after step 4: both ranks stop there (the flag is agreed), step 4 is
      saved, and the same job resumed ends with the losses of a run never stopped;
    - a save whose writes fail with ENOSPC on rank 1 only: every rank ends with one line naming the folder and the
      error, the partial folder is gone and step 1 stays the latest checkpoint."""
    from dist_utils import torchrun_json

    base = ["--job.config_file", "train_configs/debug_model.toml", *ARGS, "--training.steps", "6"]
    jobs = {
        "reference": base + VAL + ["--job.dump_folder", str(tmp_path / "reference")],
        "signalled": base + VAL + ["--job.dump_folder", str(tmp_path / "signalled")],
        "resumed": base + VAL + ["--job.dump_folder", str(tmp_path / "signalled")],
        "full_disk": base + ["--job.dump_folder", str(tmp_path / "full_disk"), "--checkpoint.enable", "true",
                             "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false"],
    }
    results = torchrun_json(2, os.path.abspath(__file__), jobs, tmp_path)
    reference, signalled, resumed = results["reference"], results["signalled"], results["resumed"]
    assert [h["step"] for h in signalled["history"]] == [1, 2, 3, 4]
    assert "validation/loss" not in signalled["history"][-1]  # step 4's validation was cut short
    assert (tmp_path / "signalled" / "checkpoint" / "step-4" / "PREEMPTED").is_file()
    assert [h["step"] for h in resumed["history"]] == [5, 6]
    assert [h["loss"] for h in signalled["history"] + resumed["history"]] == [h["loss"] for h in reference["history"]]

    error = results["full_disk"]["error"]
    assert error.startswith("saving ") and "step-2.tmp failed: rank 1: " in error, error
    assert os.strerror(errno.ENOSPC) in error and "stays the latest (step-1)" in error, error
    assert sorted(os.listdir(tmp_path / "full_disk" / "checkpoint")) == ["step-1"]


def _worker(jobs_path: str, out_path: str) -> None:
    """torchrun entry point of the 2-rank cases: each job's history (with its step), or the error it ended with."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from dist_worker import worker_session

    from trainer.checkpoint import CheckpointSaveError
    from trainer.job_config import load_config
    from trainer.train import Trainer, run

    validate, write_data = Trainer.validate, dcp_fs.FileSystemWriter.write_data
    with worker_session(jobs_path, out_path, timeout_s=300) as (jobs, results):
        for name, args in jobs.items():
            calls = []

            def signalling_validate(self):
                calls.append(1)
                if len(calls) == 2 and dist.get_rank() == 1:  # the validation after step 4, this rank only
                    os.kill(os.getpid(), signal.SIGTERM)
                return validate(self)

            def full_disk(self, plan, planner):
                if "step-2.tmp" in str(self.path) and dist.get_rank() == 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                return write_data(self, plan, planner)

            Trainer.validate = signalling_validate if name == "signalled" else validate
            dcp_fs.FileSystemWriter.write_data = full_disk if name == "full_disk" else write_data
            history: list[dict] = []
            train_step = Trainer.train_step

            def numbered(self, step):
                scalars = train_step(self, step)
                scalars["step"] = step
                return scalars

            Trainer.train_step = numbered
            try:
                run(load_config(args), shutdown=False, history=history)
                results[name] = {"history": [{k: v for k, v in h.items() if k in ("step", "loss", "validation/loss")}
                                             for h in history]}
            except CheckpointSaveError as e:
                results[name] = {"error": str(e)}
            finally:
                Trainer.train_step = train_step
            dist.barrier()
        Trainer.validate, dcp_fs.FileSystemWriter.write_data = validate, write_data


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
