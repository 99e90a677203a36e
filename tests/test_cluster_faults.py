"""Faults of a real cluster on gloo ranks: preemption signals, hung and stopped ranks, a damaged checkpoint, failed
saves.

Each fault is survived with nothing lost beyond the current step: a preempted run saves its last finished step and
the same command continues to the same final losses, bit for bit; a hung or stopped rank ends the job with one line
naming it, within the timeout plus a few seconds, leaving no process behind; a damaged checkpoint is skipped by an
unattended restart; a failed save leaves the previous checkpoint the latest.

Faults are injected from here only: a `sitecustomize` module on the ranks' PYTHONPATH (`INJECT`) wraps
`Heartbeat.advance` so that a rank pauses (for the test to send a signal at a known point) or blocks in a read that
never returns (a hung file system) at a named point of a named step. This file is also the rank worker of the
in-process cases (`python tests/test_cluster_faults.py jobs.json out.json` on ranks, `tests/dist_utils.launch_json`).
"""

import errno
import io
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

ARGS = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "1",
        "--training.deterministic", "true", "--memory.track", "off", "--validation.enable", "false",
        "--metrics.log_freq", "1"]
QUIET = ["--metrics.enable_tensorboard", "false"]

INJECT = r'''
"""Fault injection of tests/test_cluster_faults.py (test-only): CLUSTER_FAULTS, a JSON list of faults, each fired
once in the rank(s) it names when the rank's heartbeat passes the named point of the named step, or at start-up."""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

FAULTS = json.loads(os.environ.get("CLUSTER_FAULTS", "[]")) if "RANK" in os.environ else []
RANK = int(os.environ.get("RANK", "-1"))


def _act(fault, where):
    print(f"FAULT rank {RANK} {fault['do']} {where}", file=sys.stderr, flush=True)
    if fault["do"] == "block":
        read_end, write_end = os.pipe()
        os.read(read_end, 1)  # a read that never returns (a hung file system), the interpreter released
    time.sleep(fault.get("seconds", 0))


def _patch(module):
    advance = module.Heartbeat.advance
    pending = [f for f in FAULTS if "step" in f]

    def faulty(self, point, step=None, patience=0.0):
        advance(self, point, step, patience)
        for fault in list(pending):
            if fault["rank"] in (None, self.rank) and fault["step"] == self.step and point.startswith(fault["point"]):
                pending.remove(fault)
                _act(fault, f"in step {self.step} ({point})")

    module.Heartbeat.advance = faulty
    for fault in FAULTS:
        if "step" not in fault and fault["rank"] in (None, RANK):
            _act(fault, "at start-up")  # trainer.watchdog is imported at start-up, after the signal handlers


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "trainer.watchdog":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULTS:
    sys.meta_path.insert(0, _AfterImport())
'''


def _fault(rank, step, point, do="pause", seconds=4.0) -> dict:
    """Rank `rank` (None: every rank) pauses `seconds` or blocks for ever once it passes `point` of `step`."""
    return {"rank": rank, "step": step, "point": point, "do": do, "seconds": seconds}


def _final_losses(dump) -> dict[int, float]:
    """step -> loss over every tensorboard run of a dump folder (a resumed run continues the steps)."""
    from trainer.metrics import read_scalars, run_dirs

    losses = {}
    for run in run_dirs(os.path.join(dump, "tb")):
        losses.update(dict(read_scalars(run)["loss"]))
    return losses


class _Launch:
    """2 ranks in the background, through `./run_train.sh` (preflight included) or, `direct`, `python -m
    trainer.launch` (what run_train.sh execs) with torchrun's options `launcher` too; stderr (the log, the error
    lines) read line by line. `faults` are injected through `INJECT`."""

    def __init__(self, tmp_path, dump, *args, faults: list[dict] = (), direct: bool = False,
                 launcher: tuple[str, ...] = ()):
        self.lines: list[str] = []
        inject = tmp_path / "inject"
        inject.mkdir(exist_ok=True)
        (inject / "sitecustomize.py").write_text(INJECT)
        env = dict(os.environ, NGPU="2", CLUSTER_FAULTS=json.dumps(list(faults)), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")])))
        config = [*ARGS, "--job.dump_folder", str(dump), *args]
        cmd = ["./run_train.sh", *config] if not direct else [
            sys.executable, "-m", "trainer.launch", "--standalone", "--nproc_per_node=2", *launcher, "-m",
            "trainer.train", "--job.config_file", "train_configs/debug_model.toml", *config]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
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
            time.sleep(0.1)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the ranks the launcher started."""
        found = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            except (OSError, ValueError):
                continue
            if parent == self.proc.pid and b"RANK" in env:
                found[int(env[b"RANK"])] = int(entry)
        assert sorted(found) == [0, 1], found
        return found

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines[-30:])


def _left_behind(pids) -> list[int]:
    """Those of `pids` still running a moment after the job ended (a zombie waits for init to reap it)."""
    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 5
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]


def _saved_step(line: str) -> int:
    match = re.fullmatch(r"preempted by SIGTERM: checkpoint of step (\d+) saved to \S+ in [\d.]+ s, exiting "
                         r"([\d.]+) s after the signal; the same command resumes from it", line)
    assert match, line
    return int(match.group(1))


VAL = ["--training.steps", "6", "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2"]


@pytest.mark.slow
def test_preemption_of_the_launcher_and_of_one_worker_in_training_and_validation_resumes_exactly(tmp_path):
    """2 ranks, checkpoint.enable false, one run stopped three times, then finished:
    1. SIGTERM to the launcher (run_train.sh execs it: the process a scheduler signals) during step 2;
    2. SIGTERM to rank 1 only during step 3 (rank 0 stops too: the ranks agree);
    3. SIGTERM to the launcher during the validation after step 4 (cut short, step 4 saved);
    each ends with exit 75 and a checkpoint of the step; the losses of the finished run are those of a run never
    stopped, bit for bit."""
    reference = _Launch(tmp_path, tmp_path / "reference", *VAL, direct=True)
    assert reference.finish() == 0, reference.output()
    run = tmp_path / "run"
    # (step, point, the rank that pauses there for the signal to arrive, who gets it): a rank already waiting in
    # the step's poll has voted, so the signalled rank is the paused one or the launcher (which signals both)
    stops = [(2, "metrics", 0, "launcher"), (3, "metrics", 1, "rank 1"), (4, "validation batch 1/", 0, "launcher")]
    for step, point, paused, target in stops:
        # the first through run_train.sh (what a scheduler starts and signals); the others skip its preflight
        launch = _Launch(tmp_path, run, *VAL, faults=[_fault(paused, step, point)], direct=step != 2)
        launch.wait_for(f"FAULT rank {paused} pause in step {step}")
        pid = launch.proc.pid if target == "launcher" else launch.ranks()[1]
        signalled = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        assert launch.finish() == 75, launch.output()
        took = time.monotonic() - signalled
        assert _saved_step(launch.lines[-1]) == step, launch.output()
        # one line: the launcher's (the ranks leave theirs to it), and no "run done" of the steps before it
        assert sum("preempted by SIGTERM" in line for line in launch.lines) == 1, launch.output()
        assert not any("run done:" in line for line in launch.lines), launch.output()
        assert took < 30, took
        assert (run / "checkpoint" / f"step-{step}" / "PREEMPTED").is_file()
        assert not any("Traceback" in line for line in launch.lines), launch.output()
        if point.startswith("validation"):
            assert not any("validation loss" in line for line in launch.lines), launch.output()
    finished = _Launch(tmp_path, run, *VAL, direct=True)
    assert finished.finish() == 0, finished.output()
    assert any(f"resumed from {run / 'checkpoint' / 'step-4'}" in line for line in finished.lines)
    assert _final_losses(run) == _final_losses(tmp_path / "reference")


@pytest.mark.slow
def test_a_signal_at_start_up_ends_the_run_with_nothing_saved(tmp_path):
    """SIGTERM while the ranks still import (before any config or process group): recorded, honoured before the
    first step, exit 75, nothing saved."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "3", *QUIET, direct=True,
                     faults=[{"rank": None, "do": "pause", "seconds": 4}])
    launch.wait_for("FAULT rank 0 pause at start-up")
    launch.wait_for("FAULT rank 1 pause at start-up")
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish() == 75, launch.output()
    assert re.fullmatch(r"preempted by SIGTERM before step 1 finished: nothing new to save, exiting [\d.]+ s after "
                        r"the signal", launch.lines[-1]), launch.output()
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert not any("INFO step" in line for line in launch.lines), launch.output()


@pytest.mark.slow
def test_without_preemption_signals_a_sigterm_ends_the_ranks(tmp_path):
    """checkpoint.preemption_signals empty: SIGTERM takes its default action on the ranks (the handlers installed
    at start-up are removed once the config is read); nothing is saved."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "3", "--checkpoint.preemption_signals", "",
                     *QUIET, direct=True, faults=[_fault(0, 1, "metrics")])
    launch.wait_for("FAULT rank 0 pause in step 1")
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish() == 128 + signal.SIGTERM, launch.output()
    assert re.fullmatch(r"run failed on rank [01]: killed by SIGTERM", launch.lines[-1]), launch.output()
    assert not (tmp_path / "run" / "checkpoint").exists()


@pytest.mark.slow
def test_a_second_sigterm_ends_the_job_at_once(tmp_path):
    """Rank 1 blocks in a read that never returns (rank 0 then waits in a collective): a first SIGTERM cannot be
    honoured (no poll is reached), a second one to the launcher kills every rank at once: exit 143, nothing left."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "5", *QUIET, direct=True,
                     faults=[_fault(1, 2, "reading its batch", do="block")])
    launch.wait_for("FAULT rank 1 block in step 2")
    ranks = launch.ranks()
    launch.proc.send_signal(signal.SIGTERM)
    time.sleep(2)
    assert launch.proc.poll() is None, launch.output()
    signalled = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(timeout=60) == 128 + signal.SIGTERM, launch.output()
    took = time.monotonic() - signalled
    assert launch.lines[-1].startswith("run ended by a second SIGTERM: the ranks were killed at once"), launch.output()
    assert took < 5, took
    assert not _left_behind(ranks.values())


@pytest.mark.slow
def test_a_second_sigterm_ends_a_rank_blocked_in_a_c_call():
    """The rank's own path: its main thread waits in C++ (a future that never completes, as a collective waiting
    for a hung peer), where Python runs no signal handler. The first SIGTERM is recorded, and so is a copy right
    after it (SLURM signals every process and the launcher passes its own on); a second one later ends the process
    at once with 143 and one line."""
    script = ("import signal\nfrom trainer.preemption import listen\nlisten([signal.SIGTERM])\nimport torch\n"
              "print('waiting', flush=True)\ntorch.futures.Future().wait()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "waiting\n"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    time.sleep(2)
    assert proc.poll() is None
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - signalled < 3
    assert proc.stderr.read().strip().startswith("preemption: a second SIGTERM arrived before the checkpoint")


@pytest.mark.slow
def test_a_hung_but_alive_rank_is_named_within_the_timeout(tmp_path):
    """Rank 1 blocks in a read that never returns in step 3 (it keeps its heartbeat: the interpreter is free), with
    a 10 s train timeout: rank 0 names it and the point, the job ends within the timeout plus a few seconds with
    exit 1, and no process of it is left."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "1000", "--comm.train_timeout_seconds", "10",
                     *QUIET, direct=True, faults=[_fault(1, 3, "reading its batch", do="block")])
    launch.wait_for("FAULT rank 1 block in step 3")
    blocked = time.monotonic()
    ranks = launch.ranks()
    assert launch.finish(timeout=120) == 1, launch.output()
    took = time.monotonic() - blocked
    assert launch.lines[-1] == (
        "run failed on rank 0: training error: rank 1 stopped making progress in step 3 (reading its batch) while "
        "rank 0 is in step 3 (counting the batch's tokens): no rank advanced for more than "
        "comm.train_timeout_seconds = 10 s (alive but stuck in a call that does not return: a hung file system, "
        "device or peer); ending the job"), launch.output()
    assert sum("stopped making progress" in line for line in launch.lines) == 1, launch.output()
    assert took < 10 + 10, took  # measured ~12 s on the loaded 2-core machine
    assert not _left_behind(ranks.values())
    assert not any("Traceback" in line for line in launch.lines), launch.output()


@pytest.mark.slow
def test_a_stopped_rank_0_is_named_by_rank_1(tmp_path):
    """kill -STOP on rank 0 (no heartbeat) with a 10 s train timeout: rank 1 names it, the launcher kills the
    stopped rank at once (torchrun would wait 30 s), exit 1, no process left."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "1000", "--comm.train_timeout_seconds", "10",
                     *QUIET, direct=True)
    launch.wait_for(r"INFO step    3 ")
    ranks = launch.ranks()
    os.kill(ranks[0], signal.SIGSTOP)
    stopped = time.monotonic()
    assert launch.finish(timeout=120) == 1, launch.output()
    took = time.monotonic() - stopped
    last = launch.lines[-1]
    assert re.fullmatch(r"run failed on rank 1: training error: rank 0 \(in step \d+ \(.+\), silent 1\d s\) stopped "
                        r"making progress while rank 1 is in step \d+: no heartbeat for more than "
                        r"comm.train_timeout_seconds = 10 s \(stopped, frozen or holding the interpreter\); ending "
                        r"the job", last), launch.output()
    assert sum("stopped making progress" in line for line in launch.lines) == 1, launch.output()
    assert took < 10 + 10, took
    assert not _left_behind(ranks.values())


# ----------------------------------------------------------------------------------------------- one process

def test_the_watchdog_names_a_rank_without_heartbeat_a_rank_behind_or_the_point_all_ranks_are_at(monkeypatch):
    """Rank 0's watchdog in one process, over an in-memory store: rank 1 never writes a heartbeat (it counts as
    silent since the watchdog started, instead of stopping the watchdog); positions name the rank behind, or the
    point where every rank is."""
    import torch.distributed as dist

    from trainer.watchdog import Heartbeat, _Seen

    monkeypatch.setattr(Heartbeat, "PERIOD", 0.05)
    lines = []
    heartbeat = Heartbeat(dist.HashStore(), 0, 2, timeout=0.3, local_rank=0, on_hung=lines.append)
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    heartbeat.close()
    assert lines and re.fullmatch(r"training error: rank 1 \(before its first heartbeat, silent \d+ s\) stopped making "
                                  r"progress while rank 0 is in step 0: no heartbeat for more than "
                                  r"comm.init_timeout_seconds = 0.3 s \(stopped, frozen or holding the interpreter\); "
                                  r"ending the job", lines[0]), lines

    def seen(position, point):
        return _Seen(beat=5, position=position, step=7, point=point, watches=True, beat_at=99.0, advanced_at=90.0)

    heartbeat.timeout = 5
    behind = [seen(3, "optimizer"), seen(2, "reading its batch"), seen(3, "optimizer"), seen(2, "reading its batch")]
    named, line = heartbeat.verdict(behind, now=100.0)
    assert named == [1, 3] and line.startswith("training error: ranks 1, 3 stopped making progress in step 7 "
                                               "(reading its batch) while rank 0 is in step 7 (optimizer): no rank "
                                               "advanced for more than comm.init_timeout_seconds = 5 s"), line
    named, line = heartbeat.verdict([seen(3, "optimizer")] * 2, now=100.0)
    assert named == [] and line.startswith("training error: no rank advanced for more than comm.init_timeout_seconds "
                                           "= 5 s: all 2 ranks are in step 7 (optimizer)"), line
    assert heartbeat.verdict([seen(3, "optimizer")] * 2, now=94.0) is None  # advanced 4 s ago
    # a checkpoint save may take comm.checkpoint_timeout_seconds: 10 s into it is no hang, 1810 s is
    saving = _Seen(beat=5, position=3, step=7, point="checkpoint save", patience=1800.0, watches=True, beat_at=99.0,
                   advanced_at=90.0)
    assert heartbeat.verdict([saving] * 2, now=100.0) is None
    saving.beat_at = 1899.0  # alive all along: the progress rule, not the silence one
    named, line = heartbeat.verdict([saving] * 2, now=1900.0)
    assert named == [] and "no rank advanced for more than comm.checkpoint_timeout_seconds = 1800 s: all 2 ranks " \
        "are in step 7 (checkpoint save)" in line, line



@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_refused_by_name_and_never_kept_in_place_of_an_intact_one(tmp_path, caplog):
    """A truncated shard in the latest checkpoint: resume skips it with one warning, a load_step naming it is
    refused. With keep_latest_k = 1 and a damaged checkpoint newer than the one resumed from, the purge after the
    next save keeps the new checkpoint (the newest by step is the damaged one)."""
    import shutil

    from trainer.checkpoint.files import latest_checkpoint, list_checkpoints
    from core.config import ConfigError
    from trainer.job_config import load_config
    from trainer.train import prepare, run

    base = ["--job.config_file", "train_configs/debug_model.toml", *ARGS, *QUIET, "--job.dump_folder", str(tmp_path),
            "--checkpoint.enable", "true", "--checkpoint.interval", "1"]
    folder = tmp_path / "checkpoint"
    run(load_config(base + ["--training.steps", "2"]))
    shard = sorted((folder / "step-2").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(100)
    cfg = load_config(base + ["--training.steps", "3"])
    with caplog.at_level("WARNING", logger="trainer"):
        assert latest_checkpoint(cfg.checkpoint, str(tmp_path), report_skipped=True) == str(folder / "step-1")
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"step-2 (is truncated: {shard.name} is missing or too short)" in warning and "step-1" in warning
    with pytest.raises(ConfigError, match=f"is truncated: {shard.name}"):
        prepare(load_config(base + ["--training.steps", "3", "--checkpoint.load_step", "2"]), 1, 0)
    history: list[dict] = []
    run(cfg, history=history)
    assert len(history) == 2  # steps 2 and 3, resumed from step 1

    shutil.copytree(folder / "step-3", folder / "step-9")
    with open(sorted((folder / "step-9").glob("*.distcp"))[0], "r+b") as f:
        f.truncate(100)
    run(load_config(base + ["--training.steps", "4", "--checkpoint.keep_latest_k", "1"]))
    assert list_checkpoints(str(folder)) == [4, 9]
    assert latest_checkpoint(cfg.checkpoint, str(tmp_path)) == str(folder / "step-4")


# ----------------------------------------------------------------------------------------------- 2 ranks, in-process

@pytest.mark.slow
def test_failed_saves_end_every_rank_with_one_line_and_keep_the_previous_checkpoint(tmp_path):
    """One launch of 2 ranks; a save fails on one rank: DCP's writes (ENOSPC on rank 1), creating the checkpoint
    folder, writing the PREEMPTED marker of a preemption checkpoint, publishing (the rename) on rank 0. Every rank
    ends with the same line naming the folder and the error, the partial folder is gone, and the previous
    checkpoint stays the latest."""
    from dist_utils import launch_json

    base = ["--job.config_file", "train_configs/debug_model.toml", *ARGS, *QUIET, "--training.steps", "3"]
    saving = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]
    jobs = {name: base + saving + ["--job.dump_folder", str(tmp_path / name)]
            for name in ("full_disk", "no_folder", "no_rename")}
    jobs["no_marker"] = base + ["--job.dump_folder", str(tmp_path / "no_marker")]
    results = launch_json(2, os.path.abspath(__file__), jobs, tmp_path)

    def check(name, step, error, latest):
        errors = results[name]["errors"]
        assert errors[0] == errors[1], errors
        tmp = tmp_path / name / "checkpoint" / f"step-{step}.tmp"
        assert errors[0].startswith(f"saving {tmp} failed: rank {error}"), errors[0]
        assert errors[0].endswith(f"; the previous checkpoint stays the latest ({latest})"), errors[0]
        assert not tmp.exists()

    check("full_disk", 2, f"1: OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}", "step-1")
    assert sorted(os.listdir(tmp_path / "full_disk" / "checkpoint")) == ["step-1"]
    check("no_folder", 1, f"0: PermissionError: [Errno {errno.EACCES}] {os.strerror(errno.EACCES)}", "none yet")
    check("no_rename", 2, f"0: OSError: [Errno {errno.EIO}] {os.strerror(errno.EIO)}", "step-1")
    assert sorted(os.listdir(tmp_path / "no_rename" / "checkpoint")) == ["step-1"]
    check("no_marker", 2, f"0: OSError: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}", "none yet")
    assert os.listdir(tmp_path / "no_marker" / "checkpoint") == []


def _worker(jobs_path: str, out_path: str) -> None:
    """Rank entry point of the 2-rank cases: each job's error on every rank (a failed save is expected)."""
    import builtins

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs
    from dist_worker import worker_session

    import trainer.checkpoint.manager as checkpoint_manager
    from trainer.checkpoint.files import PREEMPTED_MARKER
    from trainer.checkpoint.manager import CheckpointSaveError
    from trainer.job_config import load_config
    from trainer.train import Trainer, run

    write_data, makedirs, rename, train_step = (dcp_fs.FileSystemWriter.write_data, os.makedirs, os.rename,
                                                Trainer.train_step)

    def full_disk(self, plan, planner):
        if "step-2.tmp" in str(self.path) and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return write_data(self, plan, planner)

    def no_folder(path, *args, **kwargs):
        if str(path).endswith(os.sep + "checkpoint"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return makedirs(path, *args, **kwargs)

    def no_rename(src, dst, *args, **kwargs):
        if str(src).endswith("step-2.tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return rename(src, dst, *args, **kwargs)

    def no_marker(path, *args, **kwargs):
        if str(path).endswith(PREEMPTED_MARKER):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return builtins.open(path, *args, **kwargs)

    def signalled_step(self, step):  # a preemption signal to rank 1 in step 2
        if step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self, step)

    with worker_session(jobs_path, out_path, timeout_s=300) as (jobs, results):
        for name, args in jobs.items():
            if name == "full_disk":
                dcp_fs.FileSystemWriter.write_data = full_disk
            elif name == "no_folder":
                os.makedirs = no_folder
            elif name == "no_rename":
                os.rename = no_rename
            elif name == "no_marker":
                checkpoint_manager.open, Trainer.train_step = no_marker, signalled_step
            try:
                run(load_config(args), shutdown=False)
                error = None
            except CheckpointSaveError as e:
                error = str(e)
            finally:
                dcp_fs.FileSystemWriter.write_data, os.makedirs, os.rename = write_data, makedirs, rename
                Trainer.train_step = train_step
                vars(checkpoint_manager).pop("open", None)
            errors = [None, None]
            dist.all_gather_object(errors, error)
            results[name] = {"errors": errors}


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


def test_compiling_counts_as_progress_and_a_timeout_during_a_compile_says_so_and_names_the_key(monkeypatch):
    """Two ranks' heartbeats in one process (one store), a 1 s timeout, both ranks in step 1: a fake slow compile
    (a torch.compile backend that sleeps) of several graphs, each shorter than the timeout and together longer, is
    progress, not a hang (a cold compile of many graphs on a busy machine ended a healthy run). One graph longer than
    the timeout ends the job with a line that says the ranks are compiling and names the key to raise."""
    import torch
    import torch.distributed as dist

    from trainer.watchdog import Heartbeat

    monkeypatch.setattr(Heartbeat, "PERIOD", 0.05)
    seconds = {"per_graph": 0.5}

    def slow_backend(gm, example_inputs):
        time.sleep(seconds["per_graph"])
        return gm.forward

    def graphs(x):  # each graph break starts another graph: another compile
        for _ in range(6):
            x = x * 2 + 1
            torch._dynamo.graph_break()
        return x

    def one_graph(x):
        return x * 3 - 1

    lines = []
    store = dist.HashStore()
    ranks = [Heartbeat(store, r, 2, timeout=1.0, local_rank=r, on_hung=lines.append) for r in (0, 1)]
    try:
        for heartbeat in ranks:
            heartbeat.advance("forward/backward of microbatch 1/1", step=1)
        torch.compile(graphs, backend=slow_backend)(torch.ones(2))  # ~3.5 s in all
        assert lines == []
        seconds["per_graph"] = 2.5
        torch.compile(one_graph, backend=slow_backend)(torch.ones(2))
        time.sleep(0.3)
    finally:
        for heartbeat in ranks:
            heartbeat.close()
    assert lines, "no hang reported during a compile longer than the timeout"
    assert re.fullmatch(r"training error: no rank advanced for more than comm.init_timeout_seconds = 1 s: all 2 ranks "
                        r"are in step 1 \(forward/backward of microbatch 1/1, compiling with torch.compile\): one "
                        r"graph's compile took longer than that \(a cold compile cache, a busy machine\); raise "
                        r"comm.init_timeout_seconds; ending the job", lines[0]), lines


_LOGGED = re.compile(r"^(\[rank \d+\] )?\d\d:\d\d:\d\d (INFO|WARNING) |^FAULT rank ")


def _unlogged(lines: list[str]) -> list[str]:
    """The lines of a launch other than the trainer's log records and the injected faults' own lines."""
    return [line for line in lines if not _LOGGED.match(line)]


def test_a_rank_stopped_while_writing_its_error_file_leaves_none_for_torchrun(tmp_path, monkeypatch):
    """torchrun's agent reads the error file of every rank that ended; one truncated and then left empty (a rank
    stopped mid-write by the teardown) made the agent die on a JSONDecodeError instead of restarting the job. The
    line is written whole and renamed into place: an interrupted write leaves no file, a finished one the line."""
    from trainer import launch

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    class StoppedMidWrite(io.TextIOWrapper):
        def write(self, text):
            super().write(text[:len(text) // 2])
            self.flush()
            raise OSError(errno.ENOSPC, "stopped mid-write")

    def open_stopping(file, mode="r", **kwargs):
        return StoppedMidWrite(open(file, mode.replace("w", "wb"), **kwargs))

    with monkeypatch.context() as m:
        m.setattr(launch, "open", open_stopping, raising=False)
        assert not launch.write_error_line("run failed on rank 1: ...")
    assert os.listdir(tmp_path) == []
    assert launch.write_error_line("run failed on rank 1: lost its peer", lost_peer=True)
    assert os.listdir(tmp_path) == ["error.json"]
    written = json.loads(path.read_text())
    assert written["message"] == "run failed on rank 1: lost its peer" and written["lost_peer"] is True


@pytest.mark.slow
def test_kill_9_of_a_rank_names_that_rank_not_the_one_that_lost_its_peer(tmp_path):
    """kill -9 of rank 1 while it pauses in step 2 (rank 0 waits for it in a collective and fails a moment later):
    the launcher names rank 1 and the signal, exit 137; the survivor's 'lost its peer' is no line of its own."""
    launch = _Launch(tmp_path, tmp_path / "run", "--training.steps", "20", *QUIET, direct=True,
                     faults=[_fault(1, 2, "metrics", seconds=60)])
    launch.wait_for("FAULT rank 1 pause in step 2")
    ranks = launch.ranks()
    os.kill(ranks[1], signal.SIGKILL)
    assert launch.finish(timeout=120) == 128 + signal.SIGKILL, launch.output()
    assert _unlogged(launch.lines) == ["run failed on rank 1: killed by SIGKILL (out of memory? the kernel log says)"], \
        launch.output()
    assert not _left_behind(ranks.values())


@pytest.mark.slow
def test_an_elastic_restart_says_which_rank_died_how_and_where_it_resumes(tmp_path):
    """torchrun --max-restarts=1, a checkpoint every 2 steps; kill -9 of rank 0 while it pauses in step 3: the job
    restarts and finishes (exit 0), and one line says which rank died and how, and that restart 1 of 1 resumes from
    step 2's checkpoint; nothing else but the log (no 'communication error' of the survivor)."""
    run = tmp_path / "run"
    launch = _Launch(tmp_path, run, "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval",
                     "2", *QUIET, direct=True, launcher=("--max-restarts=1",),
                     faults=[_fault(0, 3, "metrics", seconds=2)])
    launch.wait_for("FAULT rank 0 pause in step 3")
    os.kill(launch.ranks()[0], signal.SIGKILL)
    assert launch.finish(timeout=300) == 0, launch.output()
    restart = [line for line in launch.lines if "restart 1 of 1" in line]
    assert len(restart) == 1, launch.output()
    checkpoint = run / "checkpoint" / "step-2"
    assert re.fullmatch(rf"\d\d:\d\d:\d\d WARNING restart 1 of 1 \(torchrun --max-restarts\): rank 0 was killed by "
                        rf"SIGKILL \(out of memory\? the kernel log says\); resuming from {re.escape(str(checkpoint))} "
                        rf"\(step 2\)", restart[0]), restart[0]
    assert _unlogged(launch.lines) == [], launch.output()
    assert any("run done: steps 3-4 " in line for line in launch.lines), launch.output()
