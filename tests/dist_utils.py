"""Launch several training jobs in one torchrun run (tests/dist_worker.py) and collect rank 0's scalars."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    return torchrun_json(nproc, os.path.join(REPO, "tests", "dist_worker.py"), specs, tmp_path)


def torchrun_json(nproc: int, script: str, jobs: dict, tmp_path, timeout: float = 900) -> dict:
    """Launch `script jobs.json out.json` on `nproc` gloo ranks; return what rank 0 wrote to out.json."""
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs_file.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           script, str(jobs_file), str(out_file)]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-6000:]
    return json.loads(out_file.read_text())
