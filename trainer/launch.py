"""`python -m trainer.launch [torchrun options] -m trainer.train [config args]`: torchrun, ending a failed run with one
line instead of torchrun's failure report.

`run_train.sh` launches the ranks through this module. It runs `torch.distributed.run` (torchrun) with the same
options; when a rank fails, torchrun's own report (a Python traceback of `ChildFailedError` and a box per failed
rank, ~35 lines) and its "Sending process ... closing signal" lines are replaced by one last line, and the
launcher exits with the failing rank's code:

    run failed on rank 1: data error at step 4, rank 1: dataset.text_field: ... document 30 has no string field ...
    run failed on rank 0: killed by SIGKILL (out of memory? the kernel log says)
    run failed on rank 0: exit code 1 without a message (its traceback is above)

One line for the job: a rank started by this launcher leaves its last line (an error it knows, a preemption, a
hang it found) to the launcher instead of printing it too (`report_line`), so every line appears once.

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
`trainer.train.main` writes for the errors it reports in one line (`report_line`). When several ranks fail, one
fails first and the others follow: they lose their peer in a collective (their error file says so), or torchrun's
teardown stops them. torchrun stamps a rank without an error file with the second it noticed it, so the stamps of
the ranks tie; the rank is chosen by how it ended instead (`_order`): one that left a line of its own error, then
one killed by a signal other than SIGTERM (kill -9, the out-of-memory killer), then one that ended without a line
(a traceback), then one ended by SIGTERM (the teardown's signal), then one that only lost its peer; a rank that
failed seconds after the first (the teardown's SIGKILL after its 30 s) after all those; the earliest, then the
lowest rank, first.

Elastic restarts (`--max-restarts`, `MAX_RESTARTS` of run_train.sh): when torchrun restarts the ranks, the launcher
leaves which rank failed and how in its folder (`RESTART_MARKER`); rank 0 of the new attempt logs one line with it,
the restart's number and the checkpoint it resumes from (`restart_line`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time

__all__ = ["EXIT_PREEMPTED", "EXIT_SECOND_SIGTERM", "HUNG_MARKER", "LAUNCH_DIR_ENV", "PREEMPTED_PREFIX",
           "RESTART_MARKER", "launched", "leave_marker", "main", "report_line", "restart_line", "write_error_line"]

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
RESTART_MARKER = "restart"
"""Marker of an elastic restart, left before torchrun starts the new attempt: `{"restart": n, "of": N, "cause":
"rank 1 was killed by SIGKILL ..."}`."""
_LOST_PEER = "lost_peer"  # error-file field: the rank failed because another one did


def launched() -> bool:
    """Whether this process is a rank started by `trainer.launch` (which prints the job's last line)."""
    return bool(os.environ.get(LAUNCH_DIR_ENV))


def write_error_line(line: str, lost_peer: bool = False) -> bool:
    """Leave `line` (one line) for the launcher in this rank's torchrun error file; `lost_peer`: the rank failed
    because another one did (the launcher names a rank that failed on its own first). Returns whether it was
    written (nothing is, outside torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    # whole (`_write_whole`): torchrun's agent reads the file of any rank that has ended, and tears the other ranks
    # down when one fails; a rank stopped between truncating the file and writing it left it empty, and the agent
    # died on it (JSONDecodeError) instead of restarting the job (seen once in tests/test_cluster_faults.py)
    try:
        _write_whole(path, json.dumps({"message": line, "timestamp": int(time.time()), _LOST_PEER: lost_peer}))
    except OSError:
        return False  # a full disk: the caller prints the line itself
    return True


def _write_whole(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader sees the whole text or no file: written under a name of this process
    and thread (the main thread, the watchdog and the preemption reader may each write), then renamed into place.
    Raises OSError, with nothing left behind."""
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
    try:
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def report_line(line: str, lost_peer: bool = False) -> None:
    """A rank's last line: left in its error file for `trainer.launch`, which prints it once for the job; printed on
    stderr here when no launcher will (plain torchrun, a single process) or the file could not be written."""
    if not write_error_line(line, lost_peer) or not launched():
        print(line, file=sys.stderr, flush=True)


def restart_line(resumed: str) -> str | None:
    """In rank 0 of an elastic restart, the line that says so: `restart n of N (torchrun --max-restarts): <which rank
    failed and how>; <resumed>` (`resumed`: where the run resumes from); None in the first attempt."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        return None
    of, cause = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), "the previous attempt failed (see above)"
    try:
        with open(os.path.join(os.environ.get(LAUNCH_DIR_ENV, ""), RESTART_MARKER)) as f:
            marker = json.load(f)
        if marker["restart"] == restart:
            of, cause = marker["of"], marker["cause"]
    except (OSError, ValueError, KeyError):
        pass  # plain torchrun, or a launcher on another node restarted: its own line says why
    return f"restart {restart} of {of} (torchrun --max-restarts): {cause}; {resumed}"


def leave_marker(name: str, text: str) -> None:
    """Leave `text` under `name` in the launcher's folder (written whole, then renamed: the launcher polls it);
    nothing when the process was not started by `trainer.launch`."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return
    try:
        _write_whole(os.path.join(folder, name), text)
    except OSError:
        pass  # the launcher is gone (its folder with it): the job is ending anyway


class _DropReplacedRecords(logging.Filter):
    """torchrun's per-rank "closing signal" and "failed (exitcode ...)" records, which the last line replaces."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("Sending process") or message.startswith("failed (exitcode"))


LATE_S = 5
"""A rank that failed this many seconds after the first failure was ended by torchrun's teardown (its SIGKILL comes
30 s after its SIGTERM): named after every rank that failed at once."""


def _wrote_line(failure) -> bool:
    return bool(failure.error_file) and os.path.isfile(failure.error_file)


def _order(failures: dict) -> list[int]:
    """The failed ranks (global rank -> torchrun `ProcessFailure`), the one that failed on its own first (see the
    module docstring)."""
    first = min(failure.timestamp for failure in failures.values())

    def key(rank):
        failure = failures[rank]
        if _wrote_line(failure):
            kind = 4 if failure.error_file_data.get(_LOST_PEER) else 0
        elif failure.exitcode < 0:
            kind = 3 if -failure.exitcode == signal.SIGTERM else 1
        else:
            kind = 2
        return (failure.timestamp > first + LATE_S, kind, failure.timestamp, rank)

    return sorted(failures, key=key)


def _how(failure) -> tuple[str, str, int]:
    """How a rank ended: (after "run failed on rank R: ", after "rank R ", the exit code to end with)."""
    if failure.exitcode < 0:
        name = failure.signal_name()
        hint = " (out of memory? the kernel log says)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}", f"was killed by {name}{hint}", 128 - failure.exitcode
    if _wrote_line(failure):
        return failure.message, f"failed: {failure.message}", failure.exitcode
    what = f"exit code {failure.exitcode} without a message (its traceback is above)"
    return what, f"failed with {what}", failure.exitcode


def _failure_line(error) -> tuple[str, int]:
    """The one line for a torchrun `ChildFailedError`, and the exit code to end with."""
    rank = _order(error.failures)[0]
    line, _, code = _how(error.failures[rank])
    return f"run failed on rank {rank}: {line}", code


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

    def restarting(self, failures: dict, restart: int, of: int) -> None:
        """torchrun restarts the ranks after `failures` (global rank -> `ProcessFailure`): leave which rank failed
        and how for rank 0 of restart `restart` of `of` (`restart_line`)."""
        rank = _order(failures)[0]
        cause = f"rank {rank} {_how(failures[rank])[1]}"
        leave_marker(RESTART_MARKER, json.dumps({"restart": restart, "of": of, "cause": cause}))

    def preempted_line(self) -> str | None:
        """The preemption line of the lowest rank of this node that left one, or None."""
        ranks = [int(name[len(PREEMPTED_PREFIX):]) for name in os.listdir(self.folder)
                 if name.startswith(PREEMPTED_PREFIX) and name[len(PREEMPTED_PREFIX):].isdigit()]
        if not ranks:
            return None
        with open(os.path.join(self.folder, f"{PREEMPTED_PREFIX}{min(ranks)}")) as f:
            return f.read().strip()


@contextlib.contextmanager
def _noting_restarts(watch: _Watch):
    """While torchrun runs in this process: before its agent restarts the ranks, `watch.restarting` learns which
    rank failed and how. torchrun reports its restarts only in a log record; the agent's check of the ranks
    (`_monitor_workers`, which returns the failures) is wrapped instead."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if monitor is None:  # private (torch 2.13): a release without it restarts unannounced
        yield
        return

    def monitored(agent, worker_group):
        result = monitor(agent, worker_group)
        # a private attribute (torch 2.13): without it the restart goes on, only unannounced
        left, most = getattr(agent, "_remaining_restarts", 0), worker_group.spec.max_restarts
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures and left > 0:
            watch.restarting(result.failures, most - left + 1, most)
        return result

    LocalElasticAgent._monitor_workers = monitored
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; return the exit code (0, EXIT_PREEMPTED, or the failing rank's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
            with _noting_restarts(watch):
                run(args)
        except ChildFailedError as e:
            line, code = watch.failure_line(e)
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            return code
        except (KeyboardInterrupt, SignalException) as e:
            # torchrun's agent stopped the ranks (its handled signals: INT, HUP, QUIT); they leave their line here
            signum = getattr(e, "sigval", signal.SIGINT)
            print("interrupted" if signum == signal.SIGINT else f"run ended by {signal.Signals(signum).name}",
                  file=sys.stderr, flush=True)
            return 130 if signum == signal.SIGINT else 128 + signum
        finally:
            watch.close()
        line = watch.preempted_line()
        if line is not None:
            print(line, file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
