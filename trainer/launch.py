"""`python -m trainer.launch [torchrun options] -m trainer.train [config args]`: torchrun, ending a failed run with one
line instead of torchrun's failure report.

`run_train.sh` launches the ranks through this module. It runs `torch.distributed.run` (torchrun) with the same
options; when a rank fails, torchrun's own report (a Python traceback of `ChildFailedError` and a box per failed
rank, ~35 lines) and its "Sending process ... closing signal" lines are replaced by one last line, and the
launcher exits with the failing rank's code:

    run failed on rank 1: data error at step 4, rank 1: dataset.text_field: ... document 30 has no string field ...
    run failed on rank 0: killed by SIGKILL (out of memory? the kernel log says)
    run failed on rank 0: exit code 1 without a message (its traceback is above)

SIGTERM and SIGUSR1 reaching the launcher (the process a scheduler signals) are passed on to every rank, which
saves a checkpoint and exits 0 (trainer/preemption.py); every rank leaves its preemption line in the launcher's
folder (`LAUNCH_DIR_ENV`, one per launcher, so one per node), and the launcher prints the line of its lowest rank
and exits with 75 (`EXIT_PREEMPTED`): requeue and run the same command. A second SIGTERM (1 s or more after the first)
kills the ranks at once (SIGKILL: a rank blocked in a C call or holding the interpreter cannot act on a signal) and
ends with 143.

A hung rank (trainer/watchdog.py): the rank that reports it leaves a `hung` marker in the same folder; the launcher
then kills every process it started, and theirs, at once with SIGKILL instead of torchrun's SIGTERM and 30 s wait
(a stopped or stuck rank never ends by itself, and nothing is to be saved), and ends with that rank's line.

Exit codes (docs/errors.md): 0 done, 75 preempted with a checkpoint saved, 1 training error (non-finite loss with
`training.on_nonfinite = "stop"`, a memory leak with `memory.fail_on_leak`, a hung rank) or an unexpected error, 2
bad input found after launch (data, checkpoint, config), 130 interrupted, 143 a second SIGTERM, 128 + N a rank
killed by signal N.

The failing rank's line comes from the error file torchrun gives each rank (`TORCHELASTIC_ERROR_FILE`), which
`trainer.train.main` writes for the errors it reports in one line (`write_error_line`). When several ranks fail,
a rank that wrote such a line is named before one that did not (a rank that only lost its peers fails too, a
moment later), the earliest first.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time

__all__ = ["EXIT_PREEMPTED", "EXIT_SECOND_SIGTERM", "HUNG_MARKER", "LAUNCH_DIR_ENV", "PREEMPTED_PREFIX",
           "leave_marker", "main", "write_error_line"]

EXIT_PREEMPTED = 75
"""Exit code of `trainer.launch` after a preemption checkpoint (EX_TEMPFAIL: requeue and run the same command)."""
EXIT_SECOND_SIGTERM = 128 + signal.SIGTERM
"""Exit code of a rank, and of `trainer.launch`, after a second SIGTERM: no checkpoint was waited for."""
SECOND_SIGTERM_AFTER_S = 1.0
"""A SIGTERM counts as the second one only this long after the first: SLURM signals every process of a job step,
so a rank gets the scheduler's SIGTERM and the launcher's copy of it within milliseconds, which is one request."""
LAUNCH_DIR_ENV = "TRAINER_LAUNCH_DIR"
"""Environment variable the launcher sets for its ranks: a folder of its own where they leave markers for it."""
PREEMPTED_PREFIX = "preempted-"
"""Marker of a rank that ended on a preemption, `preempted-<rank>`: its line (every rank leaves one, so that every
node's launcher exits 75)."""
HUNG_MARKER = "hung"
"""Marker of a hung job: `{"rank": R, "line": ...}`, the rank that reported it and its line (trainer/watchdog.py)."""


def write_error_line(line: str) -> None:
    """Leave `line` (one line) for the launcher in this rank's torchrun error file; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line was printed already; the launcher then names the exit code only


def leave_marker(name: str, text: str) -> None:
    """Leave `text` under `name` in the launcher's folder (written whole, then renamed: the launcher polls it);
    nothing when the process was not started by `trainer.launch`."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return
    path = os.path.join(folder, name)
    try:
        with open(path + ".part", "w") as f:
            f.write(text)
        os.rename(path + ".part", path)
    except OSError:
        pass  # the launcher is gone (its folder with it): the job is ending anyway


class _DropReplacedRecords(logging.Filter):
    """torchrun's per-rank "closing signal" and "failed (exitcode ...)" records, which the last line replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Sending process") or message.startswith("failed (exitcode"))


def _failure_line(error) -> tuple[str, int]:
    """The one line for a torchrun `ChildFailedError`, and the exit code to end with."""
    failures = error.failures  # global rank -> failure

    def order(rank):
        failure = failures[rank]
        wrote_line = os.path.isfile(failure.error_file) if failure.error_file else False
        return (not wrote_line, failure.timestamp, rank)

    rank = min(failures, key=order)
    failure = failures[rank]
    where = f"run failed on rank {rank}"
    if failure.exitcode < 0:
        name = failure.signal_name()
        hint = " (out of memory? the kernel log says)" if name == "SIGKILL" else ""
        return f"{where}: killed by {name}{hint}", 128 - failure.exitcode
    if failure.error_file and os.path.isfile(failure.error_file):
        return f"{where}: {failure.message}", failure.exitcode
    return f"{where}: exit code {failure.exitcode} without a message (its traceback is above)", failure.exitcode


#: Signals the launcher passes on to the ranks instead of letting torchrun's agent stop them (the ranks' handlers,
#: `checkpoint.preemption_signals`, decide what they mean; without a handler a rank ends as the signal's default).
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
    return found


def _children() -> list[int]:
    """PIDs of this process's children (the ranks torchrun started)."""
    me = os.getpid()
    return [pid for pid, parent in _parents().items() if parent == me]


def _descendants() -> list[int]:
    """PIDs of every process below this one: the ranks and whatever they started (compile workers...)."""
    parents, found, frontier = _parents(), [], [os.getpid()]
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


class _Watch:
    """The launcher's side of a run: passes preemption signals on, kills the ranks at a second SIGTERM or when a
    rank reports a hang (it polls the `hung` marker from a thread of its own), and says how the run ended."""

    POLL_S = 0.2

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.terms = 0  # second SIGTERMs
        self._first_term_at: float | None = None
        self.hung: dict | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="launch-watch", daemon=True)
        self._thread.start()

    def on_signal(self, signum: int, frame) -> None:
        """SIGTERM or SIGUSR1 to the launcher: passed on to the ranks; a second SIGTERM kills them."""
        if signum == signal.SIGTERM:
            now = time.monotonic()
            if self._first_term_at is None:
                self._first_term_at = now
            elif now - self._first_term_at >= SECOND_SIGTERM_AFTER_S:
                self.terms += 1
            if self.terms:  # the scheduler will not wait: nothing is saved, nothing is left running
                _signal_all(_descendants(), signal.SIGKILL)
                return
        _signal_all(_children(), signum)

    def _poll(self) -> None:
        marker = os.path.join(self.folder, HUNG_MARKER)
        while not self._done.wait(self.POLL_S):
            if not os.path.isfile(marker):
                continue
            # a rank reported a hang: a stopped or stuck rank would hold torchrun's teardown for 30 s
            _signal_all(_descendants(), signal.SIGKILL)
            try:
                with open(marker) as f:
                    self.hung = json.load(f)
                os.remove(marker)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Stop polling."""
        self._done.set()
        self._thread.join(timeout=2 * self.POLL_S)

    def failure_line(self, error) -> tuple[str, int]:
        """The last line and exit code of a failed run (torchrun's `ChildFailedError`)."""
        if self.terms:
            return ("run ended by a second SIGTERM: the ranks were killed at once, without a checkpoint (the last "
                    "published checkpoint stays the latest)"), EXIT_SECOND_SIGTERM
        if self.hung is not None:
            return f"run failed on rank {self.hung['rank']}: {self.hung['line']}", 1
        return _failure_line(error)

    def preempted_line(self) -> str | None:
        """The preemption line of the lowest rank of this node that left one, or None."""
        ranks = [int(name[len(PREEMPTED_PREFIX):]) for name in os.listdir(self.folder)
                 if name.startswith(PREEMPTED_PREFIX) and name[len(PREEMPTED_PREFIX):].isdigit()]
        if not ranks:
            return None
        with open(os.path.join(self.folder, f"{PREEMPTED_PREFIX}{min(ranks)}")) as f:
            return f.read().strip()


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; return the exit code (0, EXIT_PREEMPTED, or the failing rank's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the module that logs them (a filter applies to the records of its own logger only)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropReplacedRecords())
    # Preemption: torchrun's agent would answer SIGTERM by stopping the ranks and killing them 30 s later; the ranks
    # need their grace period to save, so the launcher passes the signal on and waits for them. After a failure the
    # agent still stops the others, and kills a rank that does not stop within 30 s.
    handled = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled  # read by torchrun versions without the option
    args = parse_args(argv)
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = handled
    with tempfile.TemporaryDirectory(prefix="trainer-launch-") as folder:
        os.environ[LAUNCH_DIR_ENV] = folder
        watch = _Watch(folder)
        for sig in FORWARDED:
            signal.signal(sig, watch.on_signal)
        try:
            run(args)
        except ChildFailedError as e:
            line, code = watch.failure_line(e)
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            return code
        except KeyboardInterrupt:
            return 130
        finally:
            watch.close()
        line = watch.preempted_line()
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
