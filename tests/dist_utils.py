"""Run a worker script on several gloo ranks and collect what rank 0 writes (tests/dist_worker.py: several
training jobs per launch, rank 0's scalars); and run a command-line entry point (`python -m module`) as its own
process without paying for a fresh interpreter (`run_cli`).

The ranks are forked from a fork server that imported torch and the trainer once per test process
(`multiprocessing`'s "forkserver" start method with preloaded modules), not started by torchrun: on the 2-core
machine every fresh interpreter spent 6-7 s of CPU importing them, so a 2-rank launch of one short job cost 13.7
CPU-seconds (torchrun's own interpreter included) and a 4-rank one 25.6. Each rank still is its own process with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, the agent's store), and joins its process
group through `env://` as under torchrun, with the store served from the test process as torchrun's agent serves
it. Unlike torchrun's, the ranks share the fork server's hash seed and interpreter options and get no error file
(TORCHELASTIC_ERROR_FILE). What torchrun itself does (restarts, signals, error files, exit codes) is tested through
torchrun and run_train.sh: tests/test_cluster_faults.py, tests/test_process_exit.py, tests/test_train.py.

`run_cli` forks an entry point's process from the same server: its exit code, standard output and error are the
process's own, as `subprocess.run([sys.executable, "-m", module, ...])` gives them, for 0.1-0.3 s instead of the 6-7
CPU-seconds of a fresh interpreter's imports. Unlike a fresh interpreter, no `atexit` handler runs at its end
(multiprocessing ends a child with `os._exit`); that the real interpreter starts and ends cleanly is tested through
run_train.sh and torchrun (above) and tests/test_docs_commands.py.
"""

import gc
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: imported once in the fork server, so that no rank imports them again (the worker scripts' heavy imports; the
#: server's path is the working directory and site-packages, where the trainer's editable install lies)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.pipelining", "torch.distributed.checkpoint", "pytest",
           "trainer.train"]
#: the fork server listens on a Unix socket, <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX (TMPDIR: the test session's
#: folder, itself in the user's); a socket's path is at most 107 bytes
_SOCKET_DIR_MAX = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def launch(nproc: int, jobs: dict, tmp_path, base: list[str]) -> dict:
    """Run `jobs` in one launch of `nproc` gloo ranks; return {name: [per-step scalars of rank 0]}.

    A job is a list of extra config args, or {"args": [...], "stop_after": k} to interrupt it after step k.
    Each job writes under tmp_path/<name> unless its own args set --job.dump_folder (later args win).
    """
    specs = {}
    for name, job in jobs.items():
        extra, stop = (job, None) if isinstance(job, list) else (job["args"], job["stop_after"])
        args = base + ["--job.dump_folder", str(tmp_path / name)] + extra
        specs[name] = args if stop is None else {"args": args, "stop_after": stop}
    return launch_json(nproc, os.path.join(REPO, "tests", "dist_worker.py"), specs, tmp_path)


def launch_json(nproc: int, script: str, jobs: dict, tmp_path, timeout: float = 900) -> dict:
    """Run `script jobs.json out.json` as `__main__` on `nproc` gloo ranks (module docstring); return what rank 0
    wrote to out.json. A rank that fails, or ranks still running after `timeout` seconds, fail the test with the
    end of every rank's output (tmp_path/rank_<r>.log); the other ranks are killed."""
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    out_file.unlink(missing_ok=True)  # an earlier launch's, in the same folder
    ctx = _fork_server()
    logs = [tmp_path / f"rank_{r}.log" for r in range(nproc)]
    ranks: list = []
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True")
        for r in range(nproc):
            p = ctx.Process(target=_rank_main, name=f"rank {r}", args=(
                script, [str(jobs_file), str(out_file)], dict(env, RANK=str(r), LOCAL_RANK=str(r)), str(logs[r])))
            p.start()
            ranks.append(p)
        failure = _wait(ranks, time.monotonic() + timeout)
        if failure is None and not out_file.exists():
            failure = f"rank 0 wrote no {out_file}"
    finally:  # also when pytest-timeout or Ctrl-C interrupts the wait: no rank outlives its launch
        for p in ranks:
            if p.exitcode is None:
                p.kill()  # at once (torchrun sends SIGTERM first): a failed launch's ranks wait in collectives
            p.join()
        del store
    if failure:
        tails = [f"--- rank {r} (exit code {p.exitcode}): {logs[r]}\n{_tail(logs[r])}" for r, p in enumerate(ranks)]
        raise AssertionError(f"{failure}\n" + "\n".join(tails))
    return json.loads(out_file.read_text())


def run_cli(module: str, args: list[str], env: dict | None = None, cwd: str = REPO,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)`, with the process forked from the fork server (module docstring): the same exit code (negative
    for a signal), output and error as text, `subprocess.TimeoutExpired` after `timeout` seconds (the process
    killed)."""
    ctx = _fork_server()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        p = ctx.Process(target=_cli_main, name=f"python -m {module}",
                        args=(module, args, dict(os.environ if env is None else env), cwd, out, err))
        p.start()
        try:
            p.join(timeout)
            if p.exitcode is None:
                raise subprocess.TimeoutExpired([module, *args], timeout, _read(out), _read(err))
        finally:  # also when pytest-timeout or Ctrl-C interrupts the wait
            if p.exitcode is None:
                p.kill()
                p.join()
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], p.exitcode, _read(out), _read(err))


def _read(path) -> str:
    """What a child process wrote to `path`; "" when there is no file (it ended before it redirected its output)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _take_environment(env: dict) -> None:
    """A forked child's environment is the launching test's `env`, and its temporary files go where TMPDIR says
    (the test session's folder), as a fresh process's would."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None


def _cli_main(module: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """`python -m module *args` in a process forked from the fork server: `env`, `cwd` as the working directory and
    first import path, output and error to the files `out` and `err`. multiprocessing's child ends with the exit
    code of a SystemExit (an uncaught exception: its traceback, code 1), flushing the standard streams first."""
    _redirect(1, out)
    _redirect(2, err)
    _take_environment(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    sys.argv = ["-m", *args]  # runpy puts the module's file in front, as `python -m` does
    # runpy's warning that the module is already imported (the fork server preloaded it): a fresh `python -m` gives
    # none, and tests count the lines of the error stream
    warnings.filterwarnings("ignore", message=".* found in sys.modules after import of package",
                            category=RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _fork_server():
    """multiprocessing's forkserver context, its server started (once per process) with `PRELOAD` imported, and its
    socket in a folder short enough for a Unix socket's path (`_SOCKET_DIR_MAX`): in /tmp when TMPDIR is long (a
    cluster's scratch folder, or the session's folder in an xdist worker's)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    session_tmp = tempfile.tempdir
    if len(tempfile.gettempdir()) > _SOCKET_DIR_MAX:
        tempfile.tempdir = "/tmp"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        tempfile.tempdir = session_tmp
    return ctx


def _wait(ranks: list, deadline: float) -> str | None:
    """Wait for every rank to end; None when all exited with 0, else what went wrong (at the first failure)."""
    running = list(ranks)
    while running:
        ended = multiprocessing.connection.wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
        if not ended:
            return f"{len(running)} of {len(ranks)} ranks still running after the timeout"
        for p in [p for p in running if p.sentinel in ended]:
            p.join()
            running.remove(p)
            if p.exitcode != 0:
                return f"{p.name} ended with exit code {p.exitcode}"
    return None


def _tail(path, chars: int = 3000) -> str:
    return _read(path)[-chars:] or "(no output)"


def _rank_main(script: str, argv: list[str], env: dict, log_path: str) -> None:
    """One rank, in a process forked from the fork server: the launching test's environment and this rank's
    variables, its output to `log_path`, one thread (as OMP_NUM_THREADS=1 gives a fresh process), then `script`
    run as `__main__`."""
    _redirect(1, log_path)
    os.dup2(1, 2)
    sys.stdout.reconfigure(line_buffering=True)  # as torchrun's `python -u`: no line lost to a kill
    _take_environment(env)
    # what the fork server imported lives as long as the rank: kept out of the collector's sight, a full collection
    # walks only what the rank made, where it took 0.23 s over torch's and the trainer's objects alone
    # (tests/test_deepep.py settles its memory readings with about 100 collections per rank)
    gc.freeze()
    torch.set_num_threads(1)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as `python script` has it
    runpy.run_path(script, run_name="__main__")
