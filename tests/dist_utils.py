"""Run a worker script on several gloo ranks and collect what rank 0 writes (tests/dist_worker.py: several
training jobs per launch, rank 0's scalars).

The ranks are forked from a fork server that imported torch and the trainer once per test process
(`multiprocessing`'s "forkserver" start method with preloaded modules), not started by torchrun: on the 2-core
machine every fresh interpreter spent 6-7 s of CPU importing them, so a 2-rank launch of one short job cost 13.7
CPU-seconds (torchrun's own interpreter included) and a 4-rank one 25.6. Each rank still is its own process with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, the agent's store), and joins its process
group through `env://` as under torchrun, with the store served from the test process as torchrun's agent serves
it. Unlike torchrun's, the ranks share the fork server's hash seed and interpreter options and get no error file
(TORCHELASTIC_ERROR_FILE). What torchrun itself does (restarts, signals, error files, exit codes) is tested through
torchrun and run_train.sh: tests/test_cluster_faults.py, tests/test_process_exit.py, tests/test_train.py.
"""

import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import sys
import tempfile
import time

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
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as e:
        return f"(no output: {e})"


def _rank_main(script: str, argv: list[str], env: dict, log_path: str) -> None:
    """One rank, in a process forked from the fork server: the launching test's environment and this rank's
    variables, its output to `log_path`, one thread (as OMP_NUM_THREADS=1 gives a fresh process), then `script`
    run as `__main__`."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # as torchrun's `python -u`: no line lost to a kill
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR is the test session's folder
    torch.set_num_threads(1)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as `python script` has it
    runpy.run_path(script, run_name="__main__")
