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
saves a checkpoint and exits 0 (trainer/preemption.py); the launcher then prints the line of rank 0 and exits with
75 (`EXIT_PREEMPTED`): requeue and run the same command.

Exit codes (docs/errors.md): 0 done, 75 preempted with a checkpoint saved, 1 training error (non-finite loss with `training.on_nonfinite = "stop"`, a
memory leak with `memory.fail_on_leak`) or an unexpected error, 2 bad input found after launch (data, checkpoint,
config), 130 interrupted, 128 + N a rank killed by signal N.

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
import time

from trainer.preemption import EXIT_PREEMPTED, STOP_FILE_ENV

__all__ = ["main", "write_error_line"]


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


def _children() -> list[int]:
    """PIDs of this process's children (the ranks torchrun started), from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(int(entry))
    return found


def _forward(signum: int, frame) -> None:
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; return the exit code (0, EXIT_PREEMPTED, or the failing rank's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the module that logs them (a filter applies to the records of its own logger only)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropReplacedRecords())
    # Preemption: torchrun's agent would answer SIGTERM by stopping the ranks and killing them 30 s later; the ranks
    # need their grace period to save, so the launcher passes the signal on and waits for them. After a failure the
    # agent still stops the others, and kills a rank that does not stop within 30 s (a stopped or hung one).
    handled = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled  # read by torchrun versions without the option
    args = parse_args(argv)
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = handled
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    with tempfile.TemporaryDirectory(prefix="trainer-launch-") as tmp:
        stop_file = os.environ[STOP_FILE_ENV] = os.path.join(tmp, "preempted")
        try:
            run(args)
        except ChildFailedError as e:
            line, code = _failure_line(e)
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
            return code
        except KeyboardInterrupt:
            return 130
        if os.path.isfile(stop_file):
            with open(stop_file) as f:
                print(f.read().strip(), file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
