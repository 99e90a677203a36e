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
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "out.json"
    jobs_file.write_text(json.dumps(specs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "tests", "dist_worker.py"), str(jobs_file), str(out_file)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    return json.loads(out_file.read_text())
