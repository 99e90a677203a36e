"""Activation checkpointing by memory budget (`activation_checkpoint.mode = "budget"`), measured: for budgets between
full AC's planned peak and no AC's, the peak the run really holds (exact tracker), its step time and its losses,
beside the fixed modes; and how close the choice comes to the exact optimum of the plan.

    .venv/bin/python benchmarks/ac_budget.py                   # 1, 2 and 4 ranks, JSON lines (minutes)
    .venv/bin/python benchmarks/ac_budget.py --ngpu 2          # one layout
    .venv/bin/python benchmarks/ac_budget.py --optimality      # the choice vs the plan's optimum, no training
    .venv/bin/python benchmarks/ac_budget.py --plot docs/ac_budget.png rows.jsonl   # draw the rows of a run

Layouts: 1 rank (batch 4 x 256), FSDP 2 x EP 2 and FSDP 4 x EP 4 (2 x 256 per rank), debug model, fp32, 4 steps,
exact tracking, budgets planned as a launch plans them (expert rows at the planner's routing skew, 1.5). Rows per
layout: AC none, selective and full, then budget at 5 points evenly between full's planned peak and none's (the
fractions 1/6 ... 5/6 of the way). Per row: the budget and the planned peak; the measured peak (the largest
`memory/peak_allocated_GiB` over ranks and steps) and its ratio to the budget; the step time (the median over
steps 2-4 of the slowest rank's seconds per step, from a second run of the row with tracking off); the losses and
their largest difference from AC none's; for a budget row the choice per layer and the cheapest fixed mode whose
measured peak is within the budget, with its step time.

`--optimality`: for 9 budgets per layout, the predicted recompute seconds of the choice (`choose_ac`) and of the
exact optimum, found by branch and bound over every option of every block (none, full, per-op for every subset of
the block's ops, less those another option beats in recompute time, bytes kept and bytes held at once: no
tolerance, unlike `choose_ac`).

Under torchrun the script is its own worker: `--worker jobs.json out_dir` trains every job in one process group.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import serve_jobs, torchrun_jobs  # noqa: E402
from trainer.job_config import load_config, model_job, validate_job  # noqa: E402
from trainer.registry import get_model_spec  # noqa: E402
from trainer.tools import memory_plan  # noqa: E402
from trainer.tools.plan import DEFAULT_ROUTING_SKEW, Layout, evaluate, resolve_ac_budget  # noqa: E402
from trainer.tools.step_time import Hardware, recompute_seconds  # noqa: E402
from parallelisms.activation_checkpoint.budget import LayerChoice, per_layer_entries  # noqa: E402
from parallelisms.moe_comm.registry import get_comm_backend  # noqa: E402

GiB = 2 ** 30
STEPS = 4
BASE = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"), "--memory.track", "exact",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "false", "--checkpoint.enable", "false",
        "--metrics.log_freq", "1", "--training.seq_len", "256", "--training.steps", str(STEPS),
        "--training.deterministic", "true"]
#: ranks -> the layout's config args
LAYOUTS = {1: ["--training.local_batch_size", "4"],
           2: ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"],
           4: ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4"]}
FRACTIONS = [k / 6 for k in range(1, 6)]
#: The memory plan's stated error on these layouts (docs/memory.md, "Measured: predicted vs measured peak": every
#: row within 7%): a measured peak up to budget x (1 + PLAN_ERROR) counts as held.
PLAN_ERROR = 0.07
FIXED = ("none", "selective", "full")


def planned_peak_gib(ranks: int, args: list[str]) -> float:
    """The worst rank's planned peak of a resolved config, as a launch plans it (comm buffers included)."""
    cfg = load_config(BASE + args)
    return evaluate(cfg, Layout.of_config(cfg, ranks), ranks, "cpu", DEFAULT_ROUTING_SKEW, Hardware(), {})[
        "predicted_peak_gib"]


def rows_of(ranks: int) -> dict[str, dict]:
    """The rows of one layout: name -> {"args", "budget_gib", "planned_gib", "per_layer"}."""
    layout = LAYOUTS[ranks]
    rows = {mode: {"args": layout + ["--activation_checkpoint.mode", mode]} for mode in FIXED}
    for row in rows.values():
        row["planned_gib"] = planned_peak_gib(ranks, row["args"])
    low, high = rows["full"]["planned_gib"], rows["none"]["planned_gib"]
    for fraction in FRACTIONS:
        budget = low + fraction * (high - low)
        args = layout + ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget_gib",
                         repr(budget)]
        cfg, _ = resolve_ac_budget(load_config(BASE + args), ranks, 0.0, "cpu")
        per_layer = cfg.activation_checkpoint.per_layer
        rows[f"budget_{fraction:.3f}"] = {"args": args, "budget_gib": budget, "per_layer": per_layer,
                                          "planned_gib": planned_peak_gib(ranks, args + [
                                              "--activation_checkpoint.per_layer", ",".join(per_layer)])}
    return rows


def _measured(history: list[dict], tokens_per_step: int) -> dict:
    """What one rank's history says: peak bytes (None when tensor memory was not tracked), losses, seconds per
    step."""
    peaks = [h["memory/peak_allocated_GiB"] for h in history if "memory/peak_allocated_GiB" in h]
    return {"peak_bytes": max(peaks) * GiB if peaks else None,
            "losses": [h["loss"] for h in history],
            "step_s": [tokens_per_step / h["throughput/rank_tokens_per_s"] for h in history]}


def _train(args: list[str]) -> dict:
    """Train one row in this process (inside or outside a process group) and return what it measured."""
    from trainer.train import run

    cfg = load_config(args)
    history: list[dict] = []
    run(cfg, shutdown=False, history=history)
    return _measured(history, cfg.training.local_batch_size * cfg.training.seq_len)


def measure(ranks: int, rows: dict[str, dict], tmp: str) -> dict[str, dict]:
    """Train every row on `ranks` ranks (torchrun and gloo from 2 on; this process for 1) twice: with the exact
    tracker, for the peak over ranks and rank 0's losses, and with tracking off, for the slowest rank's seconds per
    step (the exact tracker's bookkeeping on every op costs more than the recompute being timed)."""
    jobs = {}
    for name, row in rows.items():
        jobs[name] = BASE + row["args"] + ["--job.dump_folder", os.path.join(tmp, f"{name}_{ranks}")]
        jobs[f"{name}.timed"] = BASE + row["args"] + ["--memory.track", "off", "--job.dump_folder",
                                                      os.path.join(tmp, f"{name}_{ranks}_timed")]
    if ranks == 1:
        import torch

        torch.set_num_threads(1)
        per_job = {name: [_train(args)] for name, args in jobs.items()}
    else:
        per_job = torchrun_jobs(__file__, jobs, ranks, tmp, timeout_s=3600)
    results = {}
    for name in rows:
        tracked, timed = per_job[name], per_job[f"{name}.timed"]
        results[name] = {"peak_bytes": max(p["peak_bytes"] for p in tracked),
                         "per_rank_peak_bytes": [p["peak_bytes"] for p in tracked],
                         "losses": tracked[0]["losses"],
                         "step_s": [max(steps) for steps in zip(*(p["step_s"] for p in timed))]}
    return results


def table(ranks: int, tmp: str) -> list[dict]:
    """The JSON rows of one layout (see the module docstring)."""
    rows = rows_of(ranks)
    measured = measure(ranks, rows, tmp)
    none_losses = measured["none"]["losses"]
    step_s = {name: statistics.median(m["step_s"][1:]) for name, m in measured.items()}
    out = []
    for name, row in rows.items():
        m = measured[name]
        result = {"ranks": ranks, "row": name, "planned_peak_MiB": round(row["planned_gib"] * 1024, 1),
                  "measured_peak_MiB": round(m["peak_bytes"] / 2 ** 20, 1),
                  "per_rank_peak_MiB": [round(b / 2 ** 20, 1) for b in m.get("per_rank_peak_bytes",
                                                                               [m["peak_bytes"]])],
                  "step_s": round(step_s[name], 3), "losses": m["losses"],
                  "max_loss_diff_vs_none": max(abs(a - b) for a, b in zip(m["losses"], none_losses))}
        if "budget_gib" in row:
            budget = row["budget_gib"] * GiB
            fitting = [mode for mode in FIXED if measured[mode]["peak_bytes"] <= budget]
            cheapest = min(fitting, key=step_s.__getitem__) if fitting else None
            result.update(budget_MiB=round(row["budget_gib"] * 1024, 1),
                          measured_over_budget=round(m["peak_bytes"] / budget, 4),
                          held=m["peak_bytes"] <= budget * (1 + PLAN_ERROR), per_layer=row["per_layer"],
                          cheapest_fitting_fixed=cheapest,
                          cheapest_fitting_fixed_step_s=round(step_s[cheapest], 3) if cheapest else None)
        out.append(result)
    return out


# ----------------------------------------------------------------------------------------------- optimality

def _options(items, names, dims, backend: str) -> list[tuple[float, int, int, LayerChoice]]:
    """Every option of one block as (recompute seconds, bytes kept, bytes kept + rebuilt in its backward, choice),
    less those another option beats on all three (the plan's peak grows with each byte count)."""
    ops = sorted({item.op for item in items} & set(names))
    hw = Hardware()
    always = memory_plan._plan_ops((), get_comm_backend(backend))  # host copies; the routing a recompute reuses
    found = []
    for mode, subset in [("none", ()), ("full", ())] + [("op", s) for r in range(1, len(ops) + 1)
                                                        for s in itertools.combinations(ops, r)]:
        kept, rebuilt = memory_plan._held(items, mode, frozenset(subset) | always)
        seconds = 0.0 if mode == "none" else sum(
            recompute_seconds(i.op, i.flops, i.nbytes, dims, backend, hw) for i in items
            if i.op != "input" and (mode == "full" or i.op not in subset))
        save_ops = tuple(dict.fromkeys(n for op in subset for n in names[op]))
        found.append((seconds, kept, kept + rebuilt, LayerChoice(mode, save_ops)))
    return sorted(o for o in found if not any(p[:3] != o[:3] and all(p[k] <= o[k] for k in range(3)) for p in found))


def exact_choice(cfg, ranks: int, budget: int, incumbent: float) -> tuple[float, dict[int, LayerChoice] | None]:
    """The least recompute seconds of any choice whose planned peak fits `budget` bytes (branch and bound below
    `incumbent` seconds, e.g. the chosen's, plus a little), and the choice; (incumbent, None) if none beats it."""
    dims = validate_job(cfg, ranks)
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg))
    backend = cfg.parallelism.expert_parallel_comm_backend
    names = memory_plan._savable(backend)
    blocks = [b for p in range(dims.pp)
              for b in memory_plan._rank_stage(cfg, dims, p, "cpu", DEFAULT_ROUTING_SKEW, args)[0].blocks]
    options = {b.layer: _options(b.items, names, dims, backend) for b in blocks}
    # the least peak of each block: full AC (least kept, and no more rebuilt than autograd keeps)
    least = {layer: min(opts, key=lambda o: (o[1], o[2])) for layer, opts in options.items()}
    layers = sorted(options)

    def fits(choices: dict[int, LayerChoice]) -> bool:
        full = {layer: choices.get(layer, least[layer][3]) for layer in layers}
        plans = [memory_plan.plan_rank(cfg, dims, p, "cpu", DEFAULT_ROUTING_SKEW, args, full) for p in range(dims.pp)]
        return max(r["predicted_peak_bytes"] + r["comm_buffer_bytes"] for r in plans) <= budget

    best: list = [incumbent, None]

    def search(k: int, seconds: float, chosen: dict[int, LayerChoice]) -> None:
        if k == len(layers):
            best[:] = [seconds, dict(chosen)]
            return
        for option in options[layers[k]]:  # cheapest first
            if seconds + option[0] >= best[0]:
                break
            chosen[layers[k]] = option[3]
            if fits(chosen):  # the blocks not chosen yet at their least peak
                search(k + 1, seconds + option[0], chosen)
            del chosen[layers[k]]

    search(0, 0.0, {})
    return best[0], best[1]


def optimality(ranks: int) -> list[dict]:
    """Greedy vs exact for 9 budgets between full's planned peak and none's, on one layout."""
    layout = LAYOUTS[ranks]
    low, high = (planned_peak_gib(ranks, layout + ["--activation_checkpoint.mode", m]) for m in ("full", "none"))
    cfg = load_config(BASE + layout + ["--activation_checkpoint.mode", "budget"])
    dims = validate_job(cfg, ranks)
    out = []
    for k in range(1, 10):
        budget = int((low + k / 10 * (high - low)) * GiB)
        chosen = memory_plan.choose_ac(cfg, dims, "cpu", DEFAULT_ROUTING_SKEW, budget)
        seconds, choices = exact_choice(cfg, ranks, budget, chosen.seconds * (1 + 1e-9) + 1e-12)
        out.append({"ranks": ranks, "budget_MiB": round(budget / 2 ** 20, 1),
                    "chosen_us": round(chosen.seconds * 1e6, 3), "exact_us": round(seconds * 1e6, 3),
                    "chosen_over_exact": round(chosen.seconds / seconds, 4) if seconds else 1.0,
                    "step_3_finished": chosen.exact, "chosen": per_layer_entries(chosen.choices),
                    "exact": per_layer_entries(choices) if choices else "the chosen"})
    return out


# ----------------------------------------------------------------------------------------------- plot

def plot(rows: list[dict], path: str) -> None:
    """Measured peak and step time against the budget, one column per layout; the fixed modes as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(2, len(layouts), figsize=(4.2 * len(layouts), 6.4), squeeze=False)
    titles = {1: "1 rank", 2: "FSDP 2 x EP 2", 4: "FSDP 4 x EP 4"}
    for col, ranks in enumerate(layouts):
        mine = [r for r in rows if r["ranks"] == ranks]
        budget = [r for r in mine if "budget_MiB" in r]
        x = [r["budget_MiB"] for r in budget]
        peak_ax, time_ax = axes[0][col], axes[1][col]
        peak_ax.plot(x, x, ":", color="grey", label="budget")
        peak_ax.plot(x, [b * (1 + PLAN_ERROR) for b in x], ":", color="lightgrey", label=f"budget + {PLAN_ERROR:.0%}")
        peak_ax.plot(x, [r["measured_peak_MiB"] for r in budget], "o-", label="budget: measured")
        peak_ax.plot(x, [r["planned_peak_MiB"] for r in budget], "x--", label="budget: planned")
        time_ax.plot(x, [r["step_s"] for r in budget], "o-", label="budget")
        for r, style in zip([r for r in mine if r["row"] in FIXED], ("-", "-.", "--")):
            peak_ax.axhline(r["measured_peak_MiB"], linestyle=style, linewidth=0.8, color="C3",
                            label=f"{r['row']}: measured")
            time_ax.axhline(r["step_s"], linestyle=style, linewidth=0.8, color="C3", label=r["row"])
        peak_ax.set_title(f"{titles.get(ranks, ranks)}: peak")
        peak_ax.set_ylabel("MiB")
        time_ax.set_title(f"{titles.get(ranks, ranks)}: step time")
        time_ax.set_ylabel("s per step")
        time_ax.set_xlabel("memory_budget_gib (MiB)")
        for ax in (peak_ax, time_ax):
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    """CLI (see the module docstring)."""
    if argv[:1] == ["--worker"]:
        serve_jobs(argv[1], argv[2], _train, timeout_s=600)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ngpu", type=int, choices=sorted(LAYOUTS), help="one layout (default: all)")
    parser.add_argument("--optimality", action="store_true", help="the choice vs the plan's optimum, no training")
    parser.add_argument("--plot", nargs=2, metavar=("PNG", "ROWS"), help="draw the JSON lines of ROWS into PNG")
    args = parser.parse_args(argv)
    if args.plot:
        with open(args.plot[1]) as f:
            plot([json.loads(line) for line in f if line.strip()], args.plot[0])
        return
    for ranks in [args.ngpu] if args.ngpu else sorted(LAYOUTS):
        if args.optimality:
            rows = optimality(ranks)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = table(ranks, tmp)
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
