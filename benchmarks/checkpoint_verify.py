"""What `checkpoint.verify = "checksum"` costs against the default "size": save and resume time of one process.

    python benchmarks/checkpoint_verify.py                 # the debug model (378 MiB checkpoints), 3 repeats
    python benchmarks/checkpoint_verify.py --small --repeats 1   # tests/small_models.py's SMALL (22 MiB)

Trains one step (so the optimizer state exists), then, alternating the two settings `--repeats` times, saves a
checkpoint (`CheckpointManager.save_now`: the DCP write, with "checksum" each rank's CRC32 of its own files, the
publish) and resumes from it (`CheckpointManager._resume`: with "checksum" the files checked against their CRC32,
then the DCP load), each timed from its call to its return. Prints one JSON object: the checkpoint's bytes, the
median seconds of each, the extra seconds of "checksum" and the CRC32 rate. The files are read back right after
they were written (the page cache holds them, on the machine that wrote them); a cold read from a network file
system at resume costs what reading the checkpoint costs there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))


def main(argv: list[str]) -> None:
    import torch

    from trainer.checkpoint.files import checksum_damage, write_checksums
    from trainer.checkpoint.space import folder_bytes
    from trainer.job_config import load_config
    from trainer.prepare import prepare
    from trainer.train import Trainer

    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 3
    model = []
    if "--small" in argv:
        from small_models import SMALL, hf_config_file

        model = ["--model.hf_config_path", hf_config_file(SMALL)]
    with tempfile.TemporaryDirectory(prefix="checkpoint_verify_") as dump:
        cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", *model, "--job.dump_folder", dump,
                           "--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "1",
                           "--validation.enable", "false", "--memory.track", "off",
                           "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true"])
        trainer = Trainer(prepare(cfg, 1, 0), torch.device("cpu"))
        try:
            trainer.train()
            manager = trainer.checkpoint
            times: dict[str, dict[str, list[float]]] = {v: {"save": [], "load": []} for v in ("size", "checksum")}
            for step in range(2, 2 + repeats):
                for verify in ("size", "checksum"):
                    manager.cfg.verify = verify
                    t0 = time.perf_counter()
                    path = manager.save_now(step)
                    times[verify]["save"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    assert manager._resume() == path
                    times[verify]["load"].append(time.perf_counter() - t0)
            size = folder_bytes(path) - folder_bytes(os.path.join(path, "checksums"))
            t0 = time.perf_counter()
            write_checksums(path, 0)
            crc_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert checksum_damage(path, 0, 1) is None
            crc_check = time.perf_counter() - t0
        finally:
            trainer.close()
    median = {v: {k: statistics.median(t) for k, t in kinds.items()} for v, kinds in times.items()}
    extra = {k: median["checksum"][k] - median["size"][k] for k in ("save", "load")}
    print(json.dumps({
        "model": "SMALL" if model else "debugmodel", "checkpoint_MiB": round(size / 2 ** 20, 1), "repeats": repeats,
        "seconds": {v: {k: round(t, 3) for k, t in m.items()} for v, m in median.items()},
        "checksum_extra_seconds": {k: round(t, 3) for k, t in extra.items()},
        "checksum_extra_pct": {k: round(100 * extra[k] / median["size"][k], 1) for k in extra},
        "crc32_seconds": {"save": round(crc_write, 3), "load": round(crc_check, 3)},
        "crc32_MiB_per_s": round(size / 2 ** 20 / crc_check, 1),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
