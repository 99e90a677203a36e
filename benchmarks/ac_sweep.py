"""Sweep activation-checkpointing settings on one model: memory, step time and recomputed ops per setting.

    python benchmarks/ac_sweep.py                       # debug model, batch 4 x 256 (train_configs/debug_model.toml)
    python benchmarks/ac_sweep.py --job.config_file X.toml --training.seq_len 512   # any trainer config
    python benchmarks/ac_sweep.py --smoke               # tiny model, one step per row: what the tests run
    python benchmarks/ac_sweep.py --rows full,save_ops-   # only rows whose names start with these (+ no AC)
    python benchmarks/ac_sweep.py --threads 1           # steadier CPU times on a machine shared with other jobs

Trainer config arguments, when given, replace the default ones (`--job.config_file ... --training.seq_len 256
--training.local_batch_size 4`) entirely.

Rows: no AC, full, selective per layer, selective per op with the configured save_ops, each save_ops toggle
(the configured list minus one op, and a list of just one op; ops this model never dispatches are skipped and
named on stderr), and each Megatron recompute_modules name. The `[activation_checkpoint]` section of the config
supplies the defaults the rows vary (save_ops, layer_freq, force_recompute_modules, early_stop).

Output: JSON Lines on stdout, one object per row, printed once every row is measured (progress goes to stderr).
Per row, measured on a fixed random batch with fixed weights:
  peak_bytes                   highest tensor memory during forward + backward (exact tracker: every storage)
  held_after_forward_bytes     tensor memory after forward, before backward (includes the parameters)
  activation_bytes             held_after_forward_bytes minus what was held before the forward
  step_time_s, step_cpu_s      median wall time and process CPU time of forward + backward over the timed
                               rounds (untracked; rounds interleave the rows, see `run`)
  *_rel                        the same divided by the no-AC row (time_rel: wall, cpu_rel: CPU time)
  recomputed_ops               ops dispatched in backward beyond the no-AC backward, by op-table name
                               ("other" = the rest); recomputed_total is their sum
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallelisms.activation_checkpoint.config import ActivationCheckpointSection  # noqa: E402
from parallelisms.activation_checkpoint.policy import OpCounter  # noqa: E402
from parallelisms.moe_comm.registry import op_table  # noqa: E402
from parallelisms.parallel_dims import ParallelDims  # noqa: E402
from trainer.build import build_model_parts, materialize  # noqa: E402
from trainer.job_config import JobConfig, load_config, model_job  # noqa: E402
from trainer.registry import get_model_spec  # noqa: E402

DEFAULT_CONFIG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "256",
                  "--training.local_batch_size", "4"]
# --smoke: a model small enough that all rows take seconds
SMOKE_ARGS = dict(vocab_size=64, dim=32, inter_dim=64, moe_inter_dim=16, n_layers=2, n_dense_layers=1, n_heads=2,
                  max_seq_len=32, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, q_lora_rank=0,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
SMOKE_BATCH = (1, 16)

ROW_KEYS = ("row", "mode", "granularity", "layer_freq", "save_ops", "force_recompute_modules", "recompute_modules",
            "peak_bytes", "held_after_forward_bytes", "activation_bytes", "step_time_s", "step_cpu_s", "peak_rel",
            "held_rel", "activation_rel", "time_rel", "cpu_rel", "recomputed_ops", "recomputed_total")


def sweep_settings(base: ActivationCheckpointSection, dispatched: set[str],
                   recompute_names: Sequence[str]) -> list[tuple[str, dict]]:
    """(row name, AC section overrides) for every row; toggles only for ops in `dispatched`, and one row per name of
    the model's `recompute_modules` table."""
    rows: list[tuple[str, dict]] = [
        ("none", dict(mode="none")),
        ("full", dict(mode="full")),
        (f"selective_layer_every_{base.layer_freq}", dict(mode="selective", granularity="layer")),
        ("selective_op", dict(mode="selective", granularity="op")),
    ]
    table = op_table()
    saved = table.save_ops(base.save_ops)
    for op in saved:
        if op in dispatched:
            rows.append((f"save_ops-{op}", dict(mode="selective", granularity="op",
                                                save_ops=[o for o in saved if o != op])))
    for op in table.ops:
        if op in dispatched:
            rows.append((f"save_ops=[{op}]", dict(mode="selective", granularity="op", save_ops=[op])))
    for name in recompute_names:
        rows.append((f"recompute_modules=[{name}]", dict(mode="selective", granularity="op",
                                                         recompute_modules=[name])))
    return rows


class _Bench:
    """Builds the same model and batch for every row and measures one AC setting."""

    def __init__(self, cfg: JobConfig, smoke: bool):
        self.cfg = cfg
        self.spec = get_model_spec(cfg.model.name)
        self.args = self.spec.build_args(model_job(cfg))
        self.dims = ParallelDims.from_config(cfg.parallelism, 1)
        batch, seq = (cfg.training.local_batch_size, cfg.training.seq_len)
        if smoke:
            self.args = self.args.replace(**SMOKE_ARGS)
            batch, seq = SMOKE_BATCH
        self.seed = cfg.training.seed
        self.loss_fn = self.spec.build_loss_fn(self.args)
        gen = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.args.vocab_size, (batch, seq + 1), generator=gen)
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:]

    def model(self, ac: ActivationCheckpointSection) -> torch.nn.Module:
        """The model as the trainer builds it in one process, with `ac` as its AC section."""
        cfg = dataclasses.replace(self.cfg, activation_checkpoint=ac)
        [model] = build_model_parts(self.spec, self.args, cfg, self.dims, None).parts
        materialize([model], torch.device("cpu"), self.seed)
        return model

    def step(self, model: torch.nn.Module, backward_counter: OpCounter | None = None, on_forward=None) -> None:
        loss = self.loss_fn(model(self.inputs), self.labels) / self.labels.numel()
        if on_forward is not None:
            on_forward()
        if backward_counter is None:
            loss.backward()
        else:
            with backward_counter:
                loss.backward()
        model.zero_grad(set_to_none=True)

    def timed_step(self, model: torch.nn.Module) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one forward + backward."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.step(model)
        return time.perf_counter() - wall, time.process_time() - cpu

    def memory_and_ops(self, model: torch.nn.Module) -> dict:
        """One step under the exact tracker, with the ops of its backward counted."""
        cpu = torch.device("cpu")
        tracker = MemTracker()
        tracker.track_external(model)
        counter = OpCounter()
        held: dict[str, int] = {}
        with tracker:
            before = tracker.get_tracker_snapshot("current")[cpu]["Total"]
            wall, cpu_time = time.perf_counter(), time.process_time()
            self.step(model, counter, lambda: held.setdefault("after", tracker.get_tracker_snapshot("current")[cpu]
                                                                ["Total"]))
            wall, cpu_time = time.perf_counter() - wall, time.process_time() - cpu_time
            peak = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
            tracker.reset_mod_stats()
        return dict(peak_bytes=peak, held_after_forward_bytes=held["after"], activation_bytes=held["after"] - before,
                    backward_kinds=counter.kinds, tracked_times=(wall, cpu_time))

    def dispatched_kinds(self) -> set[str]:
        """Op-table names the blocks dispatch in a forward (only those get a toggle row)."""
        model = self.model(ActivationCheckpointSection())
        counter = OpCounter()
        with counter, torch.no_grad():
            model(self.inputs)
        return {kind for kind, n in counter.kinds.items() if n and kind != "other"}


def run(config_argv: Sequence[str], smoke: bool, warmup: int, timed: int, only: Sequence[str] = (),
        out=sys.stdout) -> list[dict]:
    """Measure the rows (those starting with a prefix in `only`, if given, and always the no-AC reference),
    print them as JSON lines to `out` and return them.

    Memory and recomputed ops come from one tracked step per row. Timing runs afterwards in rounds, one step of
    every row per round, so that load from other processes spreads over all rows alike; without timed rounds
    (--smoke) the tracked step's times stand in.
    """
    cfg = load_config(list(config_argv))
    bench = _Bench(cfg, smoke)
    base = cfg.activation_checkpoint
    dispatched = bench.dispatched_kinds()
    skipped = [op for op in op_table().ops if op not in dispatched]
    print(f"ops never dispatched by this model (no toggle rows): {', '.join(skipped)}", file=sys.stderr)
    measured = []
    for name, overrides in sweep_settings(base, dispatched, list(bench.spec.plan.recompute_modules)):
        if only and name != "none" and not name.startswith(tuple(only)):
            continue
        ac = ActivationCheckpointSection(**{**vars(base), **overrides})
        print(f"measuring memory and recomputed ops: {name}", file=sys.stderr)
        model = bench.model(ac)
        measured.append((name, ac, model, bench.memory_and_ops(model), []))
    for _, _, model, _, _ in measured:
        for _ in range(warmup):
            bench.step(model)
    for i in range(timed):
        print(f"timing round {i + 1}/{timed}", file=sys.stderr)
        for _, _, model, _, times in measured:
            times.append(bench.timed_step(model))
    rows = []
    ref = None
    for name, ac, _, m, times in measured:
        wall, cpu_time = (statistics.median(t) for t in zip(*times)) if times else m["tracked_times"]
        ref = ref or dict(m, wall=wall, cpu=cpu_time)
        recomputed = {k: n - ref["backward_kinds"].get(k, 0) for k, n in sorted(m["backward_kinds"].items())}
        recomputed = {k: n for k, n in recomputed.items() if n}
        row = dict(row=name, mode=ac.mode, granularity=ac.granularity, layer_freq=ac.layer_freq,
                   save_ops=list(ac.save_ops), force_recompute_modules=list(ac.force_recompute_modules),
                   recompute_modules=list(ac.recompute_modules), peak_bytes=m["peak_bytes"],
                   held_after_forward_bytes=m["held_after_forward_bytes"], activation_bytes=m["activation_bytes"],
                   step_time_s=round(wall, 4), step_cpu_s=round(cpu_time, 4),
                   peak_rel=round(m["peak_bytes"] / ref["peak_bytes"], 4),
                   held_rel=round(m["held_after_forward_bytes"] / ref["held_after_forward_bytes"], 4),
                   activation_rel=round(m["activation_bytes"] / ref["activation_bytes"], 4),
                   time_rel=round(wall / ref["wall"], 4), cpu_rel=round(cpu_time / ref["cpu"], 4),
                   recomputed_ops=recomputed, recomputed_total=sum(recomputed.values()))
        print(json.dumps(row), file=out, flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Command line entry point; unknown arguments are trainer config overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one tracked step per row, no timing "
                        "steps (what the tests run; its times mean nothing)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    parser.add_argument("--timed", type=int, default=5, help="timed rounds (one step of every row each); the "
                        "median is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--rows", default="", help="comma-separated row-name prefixes to run (default: all; "
                        "the no-AC reference row always runs)")
    args, config_argv = parser.parse_known_args(argv)
    if not config_argv:
        config_argv = DEFAULT_CONFIG
    warmup, timed = (0, 0) if args.smoke else (args.warmup, args.timed)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = [p for p in args.rows.split(",") if p]
    return run(config_argv, args.smoke, warmup, timed, only)


if __name__ == "__main__":
    main()
