"""Layout planner: which parallel layouts fit the GPUs, ranked, before anything is launched.

`python -m trainer.plan --ngpu N --device-memory GIB [--nnodes K] [--top 10] [--json] [--routing-skew F]
[--device cuda|cpu] [--reserve-fraction F] [--calibrate-step-s S] [--hw.<input> value] [config args]`

For the model, batch and sequence of the config it enumerates the layouts the trainer accepts (the same checks as
preflight: `validate_job` and the model's own): pipeline degree and schedule, HSDP replicate x shard, expert-parallel
degree and comm backend, FSDP resharding after forward, activation checkpointing none / selective / full / budget
(a choice per layer that fits the usable memory, `choose_ac`; listed where it mixes choices), and the
FP8 recipes when the config enables FP8. Each gets the memory plan of every pipeline stage's first rank
(`trainer.tools.memory_plan.plan_rank`, expert rows at the routing skew) plus the comm backend's own buffers, and a
step time (`trainer.tools.step_time`). Layouts whose worst rank fits `device memory x (1 - reserve)` are ranked by
predicted throughput (tokens per second and GPU: layouts differ in their data-parallel degree, hence in tokens
per step); the others are summarised in one line per family (pipeline x EP degree) with their smallest peak.

Without a config it plans the trainer's default (`train_configs/debug_model.toml`, `DEFAULT_CONFIG_FILE` in
`trainer/job_config.py`), and without `--device` for this machine's device, as the trainer would run. Exit code 0
when a layout fits, 3 (`NOTHING_FITS`) when none does (the plan is printed all the same, then one line saying what
can help), 2 for bad input.

`parallelism.auto = true` runs `choose_layout` in every rank's preflight (`trainer.prepare`): the keys of the
layout that the TOML or the command line set stay as given; the planner picks the rest. `activation_checkpoint.mode
= "budget"` runs `resolve_ac_budget` there: the choice per layer that fits `memory_budget_gib`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from core.config import ConfigError, check_fields, run_with_config_errors
from parallelisms.moe_comm.registry import COMM_BACKENDS, get_comm_backend
from parallelisms.parallel_dims import ParallelismSection
from parallelisms.pipeline import schedule_problem
from quantization.fp8.accounting import fp8_flops_per_token
from quantization.fp8.config import RECIPES, fp8_selection
from trainer.device import device_type
from trainer.job_config import JobConfig, load_command_config, model_job, validate_job
from trainer.registry import available_models, get_model_spec
from parallelisms.activation_checkpoint.budget import parse_per_layer, per_layer_entries
from trainer.tools.memory_plan import budget_refusal, choose_ac, describe_choices, plan_rank
from trainer.tools.step_time import Hardware, fp8_operands, step_time

__all__ = ["DEFAULT_ROUTING_SKEW", "NOTHING_FITS", "Layout", "choose_layout", "main", "nothing_fits", "plan_layouts",
           "resolve_ac_budget"]

GiB = 2 ** 30
#: Expert rows a rank receives over the balanced mean, assumed unless --routing-skew says otherwise. The debug
#: model's first 20 steps show 1.03-1.33 (EP 2) and 1.09-1.93 (EP 4) for the median layer, up to 2.6 for the
#: worst (docs/memory.md, "Routing skew"); runs log theirs as `moe/layer_<i>/ep_rank_max_over_mean`.
DEFAULT_ROUTING_SKEW = 1.5
#: Device memory kept out of the plan: CUDA context, NCCL buffers, the caching allocator's fragmentation.
DEFAULT_RESERVE = 0.10
_AC_MODES = ("none", "selective", "full", "budget")
NOTHING_FITS = 3
"""Exit code of `python -m trainer.plan` when no layout fits (the plan is printed all the same; docs/errors.md)."""


@dataclass(frozen=True)
class Layout:
    """One parallel layout: the `[parallelism]`, `[activation_checkpoint]` and `[fp8]` keys the planner chooses."""

    pp: int
    pp_schedule: str
    dp_replicate: int
    dp_shard: int
    ep: int
    backend: str
    reshard: str
    ac: str
    fp8: str
    cp: int = 1

    @classmethod
    def of_config(cls, cfg: JobConfig, world_size: int) -> "Layout":
        """The layout `cfg` asks for on `world_size` ranks."""
        par = cfg.parallelism
        return cls(par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.data_parallel_replicate_degree,
                   validate_job(cfg, world_size).dp_shard, par.expert_parallel_degree,
                   par.expert_parallel_comm_backend, par.fsdp_reshard_after_forward, cfg.activation_checkpoint.mode,
                   cfg.fp8.recipe, par.context_parallel_degree)

    @classmethod
    def of_row(cls, row: dict) -> "Layout":
        """The layout of one row of `plan_layouts`."""
        return cls(*(row[f.name] for f in dataclasses.fields(cls)))

    def settings(self) -> dict[str, object]:
        """The config keys of this layout, as `section.key`: value."""
        return {"parallelism.pipeline_parallel_degree": self.pp,
                "parallelism.pipeline_parallel_schedule": self.pp_schedule,
                "parallelism.data_parallel_replicate_degree": self.dp_replicate,
                "parallelism.data_parallel_shard_degree": self.dp_shard,
                "parallelism.expert_parallel_degree": self.ep,
                "parallelism.expert_parallel_comm_backend": self.backend,
                "parallelism.fsdp_reshard_after_forward": self.reshard,
                "parallelism.context_parallel_degree": self.cp,
                "activation_checkpoint.mode": self.ac, "fp8.recipe": self.fp8}

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` with this layout's keys (the sections it changes are copied; the rest are shared)."""
        par = dataclasses.replace(cfg.parallelism, pipeline_parallel_degree=self.pp,
                                  pipeline_parallel_schedule=self.pp_schedule,
                                  data_parallel_replicate_degree=self.dp_replicate,
                                  data_parallel_shard_degree=self.dp_shard, expert_parallel_degree=self.ep,
                                  expert_parallel_comm_backend=self.backend,
                                  fsdp_reshard_after_forward=self.reshard, context_parallel_degree=self.cp,
                                  auto=False)
        ac = dataclasses.replace(cfg.activation_checkpoint, mode=self.ac)
        if self.ac != cfg.activation_checkpoint.mode:
            # the budget and its choice per layer belong to the config's own mode (evaluate chooses per layout)
            ac = dataclasses.replace(ac, memory_budget_gib=0.0, per_layer=[])
        fp8 = dataclasses.replace(cfg.fp8, recipe=self.fp8)
        return dataclasses.replace(cfg, parallelism=par, activation_checkpoint=ac, fp8=fp8)

    def describe(self) -> str:
        """One line: the degrees, then the other choices."""
        pipe = f"pp={self.pp} {self.pp_schedule}" if self.pp > 1 else "pp=1"
        dp = f"hsdp={self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"fsdp={self.dp_shard}"
        ep = f"ep={self.ep} {self.backend}" if self.ep > 1 else "ep=1"
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        fp8 = f" fp8={self.fp8}" if self.fp8 != "none" else ""
        return f"{pipe} {dp}{cp} {ep} reshard={self.reshard} ac={self.ac}{fp8}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: layout field -> config key whose explicit value `parallelism.auto` keeps
_FIELD_KEYS = {"pp": ("parallelism", "pipeline_parallel_degree"),
               "pp_schedule": ("parallelism", "pipeline_parallel_schedule"),
               "dp_replicate": ("parallelism", "data_parallel_replicate_degree"),
               "dp_shard": ("parallelism", "data_parallel_shard_degree"),
               "ep": ("parallelism", "expert_parallel_degree"),
               "backend": ("parallelism", "expert_parallel_comm_backend"),
               "reshard": ("parallelism", "fsdp_reshard_after_forward"),
               "cp": ("parallelism", "context_parallel_degree"),
               "ac": ("activation_checkpoint", "mode"), "fp8": ("fp8", "recipe")}


def explicit_fields(cfg: JobConfig) -> dict[str, object]:
    """The layout fields the config sets away from their defaults (what `parallelism.auto` keeps)."""
    defaults = JobConfig()
    fixed = {}
    for name, (section, key) in _FIELD_KEYS.items():
        value = getattr(getattr(cfg, section), key)
        if value != getattr(getattr(defaults, section), key):
            fixed[name] = value
    return fixed


def candidates(cfg: JobConfig, ngpu: int, fixed: dict[str, object] | None = None) -> Iterator[Layout]:
    """Every combination of the layout keys for `ngpu` ranks, `fixed` fields held; the trainer's checks come later."""
    fixed = fixed or {}
    schedules = ParallelismSection.__dataclass_fields__["pipeline_parallel_schedule"].metadata["choices"]
    fp8s = list(RECIPES) if cfg.fp8.recipe != "none" else ["none"]
    # the degrees first (each depends on the previous), then the choices each degree allows; EP borrows from
    # dp_shard x cp
    degrees = [(pp, rep, cp, ngpu // (pp * rep * cp), ep) for pp in _divisors(ngpu) for rep in _divisors(ngpu // pp)
               for cp in _cp_degrees(cfg, ngpu // (pp * rep), fixed) for ep in _divisors(ngpu // (pp * rep))]
    for pp, rep, cp, shard, ep in degrees:
        for schedule, backend, reshard, ac, fp8 in itertools.product(
                schedules if pp > 1 else ["1F1B"], COMM_BACKENDS if ep > 1 else ["alltoall"],
                ("always", "never") if shard * cp > 1 else ("default",), _AC_MODES, fp8s):
            layout = Layout(pp, schedule, rep, shard, ep, backend, reshard, ac, fp8, cp)
            if all(_matches(layout, k, v) for k, v in fixed.items()):
                yield layout


CP_MIN_SEQ_LEN = 8192
"""Shortest sequence for which the planner tries context parallelism unless the config sets its degree: below it,
a sequence's activations are small beside the weights (DeepSeek-V3 itself pre-trained at 4096 without it)."""
CP_MAX = 8
"""Largest context-parallel degree tried: its all-gathers of every attention layer stay within a node."""


def _cp_degrees(cfg: JobConfig, ranks: int, fixed: dict[str, object]) -> list[int]:
    """Context-parallel degrees to try among `ranks`: the config's own when it sets one, else 1, and from
    `CP_MIN_SEQ_LEN` tokens up every degree up to `CP_MAX` that splits the sequence into 2 * cp chunks."""
    if "cp" in fixed:
        return [fixed["cp"]] if ranks % fixed["cp"] == 0 else []
    seq_len = cfg.training.seq_len
    if seq_len < CP_MIN_SEQ_LEN:
        return [1]
    return [cp for cp in _divisors(ranks) if cp <= CP_MAX and seq_len % (2 * cp) == 0]


def _matches(layout: Layout, field: str, value: object) -> bool:
    mine = getattr(layout, field)
    if field == "dp_shard" and value == -1:
        return True
    if field == "reshard" and value == "default":
        return True
    return mine == value


def _fp8_fraction(spec, args, cfg: JobConfig) -> float:
    """Share of the training FLOPs the FP8 recipe of `cfg` runs as FP8 GEMMs."""
    if cfg.fp8.recipe == "none" or spec.tools.module_flops is None:
        return 0.0
    total = spec.param_and_flop_counts(args, cfg.training.seq_len)[2]
    return fp8_flops_per_token(fp8_selection(cfg.fp8, spec.plan.module_defaults), spec.tools.module_flops(args)) / total


def evaluate(cfg: JobConfig, layout: Layout, ngpu: int, device: str, skew: float, hw: Hardware,
             cache: dict, budget_gib: float | None = None) -> dict:
    """The worst rank's predicted peak and the step time of `layout`; ConfigError when the trainer would refuse it.
    `cache` keeps model args and stage plans between the layouts of one planning run. With AC mode budget the
    choice per layer is chosen for `budget_gib` (`choose_ac`; None: the config's `activation_checkpoint.per_layer`)
    and given as `per_layer` (with `budget_fits`)."""
    job = layout.apply(cfg)
    dims = validate_job(job, ngpu, fields_checked=True)
    schedule = schedule_problem(layout.pp_schedule, device)
    if dims.pp_enabled and schedule is not None:
        raise ConfigError(*schedule)
    spec = get_model_spec(job.model.name)
    if dims.pp_enabled and spec.pipeline is None:
        raise ConfigError("parallelism.pipeline_parallel_degree", f"model {job.model.name!r} has no pipeline split",
                          "1")
    key = ("args", layout.ep, layout.pp, layout.fp8)
    if key not in cache:
        cache[key] = spec.build_args(model_job(job))
    args = cache[key]
    # the replicas' count changes no rank's memory (only whether there is data parallelism at all), the comm
    # backend only its own buffers (added below)
    memory_key = dataclasses.replace(layout, dp_replicate=min(layout.dp_replicate, 2), backend="")
    budget = {}
    try:
        if layout.ac == "budget":
            if budget_gib is not None:
                # the choice depends on the backend: its op names, its exchange's speed, its buffers
                key = ("budget", dataclasses.replace(memory_key, backend=layout.backend), budget_gib)
                if key not in cache:
                    cache[key] = choose_ac(job, dims, device, skew, int(budget_gib * GiB), args, hw, quick=True)
                job = dataclasses.replace(job, activation_checkpoint=dataclasses.replace(
                    job.activation_checkpoint, memory_budget_gib=budget_gib, per_layer=per_layer_entries(
                        cache[key].choices)))
                budget["budget_fits"] = cache[key].fits
            budget["per_layer"] = list(job.activation_checkpoint.per_layer)
            memory_key = (memory_key, tuple(budget["per_layer"]))
        ranks = []
        for p in range(dims.pp):
            if (memory_key, p) not in cache:
                cache[memory_key, p] = plan_rank(job, dims, p, device, skew, args)
            ranks.append(cache[memory_key, p])
    except ValueError as e:  # the pipeline split (too many stages for the model's units)
        raise ConfigError("parallelism.pipeline_parallel_degree", str(e), "fewer pipeline stages") from None
    backend = get_comm_backend(layout.backend)
    buffers = [backend.planned_buffer_bytes(r["work"]["token_bytes"], dims.ep) if dims.ep_enabled else 0
               for r in ranks]
    demand = [r["predicted_peak_bytes"] + b for r, b in zip(ranks, buffers)]
    worst = max(range(len(ranks)), key=demand.__getitem__)
    tr = job.training
    accumulation = 1 if tr.global_batch_size == -1 else tr.global_batch_size // (tr.local_batch_size * dims.dp)
    fraction = _fp8_fraction(spec, args, job)
    schedule = layout.pp_schedule if dims.pp_enabled else None
    reshard = layout.reshard == "always" or (layout.reshard == "default" and not dims.pp_enabled)
    times = [step_time(dims, schedule, reshard, accumulation, r["work"], fraction, layout.backend, hw,
                       fp8_operands(spec, args, job, dims, r["work"])) for r in ranks]
    slowest = max(times, key=lambda t: t["step_s"])
    tokens = tr.local_batch_size * tr.seq_len * dims.dp * accumulation
    return {**dataclasses.asdict(layout),
            "predicted_peak_gib": demand[worst] / GiB, "worst_stage": worst,
            "allocator_peak_gib": ranks[worst]["predicted_peak_bytes"] / GiB,
            "comm_buffer_gib": buffers[worst] / GiB,
            "peak_phase": ranks[worst]["peak_phase"],
            "predicted_step_s": slowest["step_s"], "step_breakdown_s": slowest,
            "tokens_per_s_per_gpu": tokens / slowest["step_s"] / ngpu, "layout": layout.describe(),
            "settings": layout.settings() | _budget_settings(job, budget), **budget}


def _budget_settings(job: JobConfig, budget: dict) -> dict[str, object]:
    """The config keys of a budget row's choice, as command-line values (a list as a,b,c)."""
    if "per_layer" not in budget:
        return {}
    return {"activation_checkpoint.memory_budget_gib": job.activation_checkpoint.memory_budget_gib,
            "activation_checkpoint.per_layer": ",".join(budget["per_layer"])}


def plan_layouts(cfg: JobConfig, ngpu: int, memory_gib: float, device: str = "cuda",
                 skew: float = DEFAULT_ROUTING_SKEW, hw: Hardware = Hardware(), reserve: float = DEFAULT_RESERVE,
                 fixed: dict[str, object] | None = None) -> dict:
    """Every accepted layout of `cfg` on `ngpu` ranks of `memory_gib` each: {"layouts": fitting ones, most tokens
    per second and GPU first,
    then the rest by peak, each with `fits`; "rejected": one line per refused or non-fitting family; ...}."""
    usable = memory_gib * (1 - reserve)
    check_fields(cfg)  # once: the layouts only set keys to allowed values
    ac = cfg.activation_checkpoint
    # AC mode budget fits the usable memory, or the config's own budget where it sets a smaller one
    budget_gib = min(usable, ac.memory_budget_gib) if ac.mode == "budget" and ac.memory_budget_gib else usable
    fixed = fixed or {}
    layouts, refused, budgets = [], {}, []
    cache: dict = {}

    def add(layout: Layout) -> None:
        try:
            row = evaluate(cfg, layout, ngpu, device, skew, hw, cache, budget_gib)
        except ConfigError as e:
            reason = f"{e.key}: {e.problem}"
            refused.setdefault(reason, []).append(layout)
            return
        if row["ac"] == "budget" and fixed.get("ac") != "budget" and not _mixed(row):
            return  # the same as the layout with AC none or full
        row["fits"] = row["predicted_peak_gib"] <= usable and row.get("budget_fits", True)
        row["headroom_gib"] = usable - row["predicted_peak_gib"]
        layouts.append(row)

    for layout in candidates(cfg, ngpu, fixed):
        if layout.ac == "budget" and fixed.get("ac") != "budget":
            budgets.append(layout)
        else:
            add(layout)
    # AC mode budget mixes choices only where full AC fits and no AC does not
    fits = {Layout.of_row(r): r["fits"] for r in layouts}
    for layout in budgets:
        if fits.get(dataclasses.replace(layout, ac="full")) and not fits.get(dataclasses.replace(layout, ac="none")):
            add(layout)
    # layouts differ in their data-parallel degree, hence in tokens per step: rank by throughput
    fitting = sorted((r for r in layouts if r["fits"]),
                     key=lambda r: (-r["tokens_per_s_per_gpu"], r["predicted_peak_gib"]))
    too_big = sorted((r for r in layouts if not r["fits"]), key=lambda r: r["predicted_peak_gib"])
    rejected = []
    families: dict[tuple[int, int], dict] = {}
    for r in too_big:
        families.setdefault((r["pp"], r["ep"]), r)
    for (pp, ep), r in sorted(families.items()):
        if any(f["pp"] == pp and f["ep"] == ep for f in fitting):
            continue
        rejected.append(f"pp={pp} ep={ep}: smallest peak {r['predicted_peak_gib']:.2f} GiB ({r['layout']}) > "
                        f"{usable:.2f} GiB usable, on stage {r['worst_stage']}")
    for reason, group in refused.items():
        rejected.append(f"{group[0].describe()} and {len(group) - 1} more: {reason}" if len(group) > 1 else
                        f"{group[0].describe()}: {reason}")
    return {"model": f"{cfg.model.name}/{cfg.model.flavor}", "ngpu": ngpu, "device_memory_gib": memory_gib,
            "usable_gib": usable, "reserve_fraction": reserve, "routing_skew": skew, "device": device,
            "batch": [cfg.training.local_batch_size, cfg.training.seq_len], "hardware": dataclasses.asdict(hw),
            "layouts": fitting + too_big, "rejected": rejected,
            "evaluated": len(layouts), "refused": sum(len(g) for g in refused.values())}


def _mixed(row: dict) -> bool:
    """Whether a budget row's choice fits and is no fixed mode's (not none or full on every block)."""
    return row["budget_fits"] and {entry.partition("=")[2] for entry in row["per_layer"]} not in ({"none"}, {"full"})


def choose_layout(cfg: JobConfig, world_size: int, memory_gib: float, device: str,
                  skew: float = DEFAULT_ROUTING_SKEW) -> tuple[JobConfig, str]:
    """`parallelism.auto`: the fastest fitting layout that keeps the explicitly set layout keys, applied to `cfg`,
    and the one line that says so; ConfigError naming the smallest peak found when none fits."""
    fixed = explicit_fields(cfg)
    result = plan_layouts(cfg, world_size, memory_gib, device, skew, fixed=fixed)
    fits = [r for r in result["layouts"] if r["fits"]]
    if not fits:
        problem, fixes = nothing_fits(result, cfg, fixed)
        if not result["layouts"]:
            fixes += ", or parallelism.auto = false"
        raise ConfigError("parallelism.auto", problem, fixes)
    best = fits[0]
    layout = Layout.of_row(best)
    line = (f"parallelism.auto: {best['layout']} (predicted peak {best['predicted_peak_gib']:.2f} of "
            f"{result['usable_gib']:.2f} GiB usable, step {best['predicted_step_s']:.3g} s uncalibrated; "
            f"{len(fits)} of {result['evaluated']} layouts fit)")
    chosen = layout.apply(cfg)
    if layout.ac == "budget":
        chosen = dataclasses.replace(chosen, activation_checkpoint=dataclasses.replace(
            chosen.activation_checkpoint, memory_budget_gib=best["settings"]["activation_checkpoint.memory_budget_gib"],
            per_layer=best["per_layer"]))
    return chosen, line


def nothing_fits(result: dict, cfg: JobConfig, fixed: dict[str, object] | None = None) -> tuple[str, str]:
    """(what, what can help) when no layout of `result` (`plan_layouts` of `cfg`, `fixed` fields held) fits. Only
    what can lower the smallest peak is suggested: full activation checkpointing only where the planner did not
    try it (the config holds another mode), a smaller batch only above one sequence, a shorter sequence only
    above one token."""
    fixed = fixed or {}
    kept = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing"
    if not result["layouts"]:
        return (f"no layout of {result['ngpu']} ranks passes the trainer's checks (keeping {kept}): "
                f"{'; '.join(result['rejected'][:3])}", "other degrees")
    best = result["layouts"][0]
    # rounded up: GPUs of the size named do fit the smallest peak
    need = math.ceil(best["predicted_peak_gib"] / (1 - result["reserve_fraction"]) * 100) / 100
    fixes = [f"more GPUs or GPUs of >= {need:.2f} GiB"]
    if fixed.get("ac", "full") not in ("full", "budget"):  # a budget's choices include full AC on every block
        fixes.append("activation_checkpoint.mode = full")
    tr = cfg.training
    if tr.local_batch_size > 1:
        fixes.append(f"a training.local_batch_size below {tr.local_batch_size}")
    if tr.seq_len > 1:
        fixes.append(f"a training.seq_len below {tr.seq_len}")
    return (f"no layout fits {result['usable_gib']:.2f} GiB per rank (keeping {kept}); the smallest peak is "
            f"{best['predicted_peak_gib']:.2f} GiB ({best['layout']})", ", ".join(fixes))


def resolve_ac_budget(cfg: JobConfig, world_size: int, memory_gib: float, device: str,
                      skew: float = DEFAULT_ROUTING_SKEW) -> tuple[JobConfig, list[str]]:
    """AC mode budget before launch: `cfg` with the choice per layer in `activation_checkpoint.per_layer` (chosen
    by `choose_ac` when empty) and the budget in `memory_budget_gib` (0: `memory_gib` per rank less the reserve),
    and the lines that show the choice: the budget, the planned peak, the predicted recompute share of the step,
    then per layer what is saved and what is recomputed. ConfigError when even full AC on every block cannot meet
    the budget, or a given `per_layer` plans a peak over it."""
    ac = cfg.activation_checkpoint
    budget_gib = ac.memory_budget_gib or memory_gib * (1 - DEFAULT_RESERVE)
    dims = validate_job(cfg, world_size)
    args = get_model_spec(cfg.model.name).build_args(model_job(cfg))
    if ac.per_layer:
        choices = parse_per_layer(ac.per_layer)
    else:
        result = choose_ac(cfg, dims, device, skew, int(budget_gib * GiB), args)
        if not result.fits:
            raise budget_refusal(result, budget_gib, skew)
        choices = result.choices
    cfg = dataclasses.replace(cfg, activation_checkpoint=dataclasses.replace(
        ac, memory_budget_gib=budget_gib, per_layer=per_layer_entries(choices)))
    row = evaluate(cfg, Layout.of_config(cfg, world_size), world_size, device, skew, Hardware(), {})
    if row["predicted_peak_gib"] > budget_gib:
        raise ConfigError("activation_checkpoint.per_layer", f"plans a peak of {row['predicted_peak_gib']:.3f} GiB, "
                          f"over memory_budget_gib {budget_gib:g}", "[] (chosen before launch), or a larger "
                          "activation_checkpoint.memory_budget_gib")
    breakdown = row["step_breakdown_s"]
    lines = [f"activation_checkpoint.mode = budget: {budget_gib:.3f} GiB per rank; planned peak "
             f"{row['predicted_peak_gib']:.3f} GiB (worst rank, stage {row['worst_stage']}, routing skew {skew:g}); "
             f"predicted recompute {breakdown['recompute_s'] / breakdown['step_s']:.1%} of the step "
             "(uncalibrated step-time model)"]
    return cfg, lines + [f"  {line}" for line in describe_choices(cfg, dims, device, skew, args, choices)]


def calibrate(cfg: JobConfig, ngpu: int, device: str, skew: float, hw: Hardware, measured_s: float) -> Hardware:
    """`hw` with the efficiency that makes the config's own layout predict `measured_s` per step (bisection: the
    step time falls as the efficiency rises)."""
    own = Layout.of_config(cfg, ngpu)
    lo, hi = 1e-4, 1.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        row = evaluate(cfg, own, ngpu, device, skew, hw.with_values(efficiency=mid), {})
        lo, hi = (mid, hi) if row["predicted_step_s"] > measured_s else (lo, mid)
    return hw.with_values(efficiency=math.sqrt(lo * hi))


def _print(result: dict, top: int, seconds: float) -> None:
    print(f"layout plan: {result['model']} on {result['ngpu']} x {result['device_memory_gib']:g} GiB "
          f"({result['usable_gib']:.2f} GiB usable after a {result['reserve_fraction']:.0%} reserve), batch "
          f"{result['batch'][0]} x {result['batch'][1]} per rank, routing skew {result['routing_skew']:g} "
          f"(expert rows at {result['routing_skew']:g} x the balanced mean)")
    fits = [r for r in result["layouts"] if r["fits"]]
    print(f"{len(fits)} of {result['evaluated']} accepted layouts fit ({result['refused']} refused by the trainer's "
          f"checks; {seconds:.1f} s). Step times rank layouts; they are not seconds until calibrated "
          "(--calibrate-step-s).")
    if fits:
        print(f"{'#':>3}  {'peak GiB':>8}  {'headroom':>8}  {'step s':>8}  {'tok/s/GPU':>9}  layout")
        for i, r in enumerate(fits[:top], 1):
            print(f"{i:>3}  {r['predicted_peak_gib']:>8.2f}  {r['headroom_gib']:>8.2f}  {r['predicted_step_s']:>8.3g}  "
                  f"{r['tokens_per_s_per_gpu']:>9.0f}  {r['layout']}")
    for line in result["rejected"]:
        print(f"  rejected {line}")


_HW_FIELDS = {f.name: f.type for f in dataclasses.fields(Hardware)}


def _bad(flag: str, value: str, allowed: str) -> ConfigError:
    return ConfigError(flag, f"{value!r} is not valid", allowed)


def _number(flag: str, value: str, kind=float, low: float = 0.0):
    try:
        number = kind(value)
    except ValueError:
        raise _bad(flag, value, f"a {'whole ' if kind is int else ''}number > {low:g}") from None
    if not number > low or not math.isfinite(number):
        raise _bad(flag, value, f"a {'whole ' if kind is int else ''}number > {low:g}")
    return number


def main(argv: list[str]) -> None:
    """The command line (see the module docstring)."""
    argv = list(argv)
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    opts: dict[str, str] = {}
    hw_values: dict[str, float] = {}
    rest = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ("--ngpu", "--device-memory", "--nnodes", "--top", "--routing-skew", "--device",
                    "--reserve-fraction", "--calibrate-step-s", "--config") or name.startswith("--hw."):
            if "=" in a:
                value, i = a.split("=", 1)[1], i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                raise ConfigError(name, "needs a value", "see python -m trainer.plan --help")
            if name.startswith("--hw."):
                field = name[len("--hw."):]
                if field not in _HW_FIELDS:
                    raise ConfigError(name, "is not a hardware input", ", ".join(f"--hw.{f}" for f in _HW_FIELDS))
                hw_values[field] = _number(name, value, int if field == "gpus_per_node" else float)
            else:
                opts[name] = value
            continue
        rest.append(a)
        i += 1
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return
    for required in ("--ngpu", "--device-memory"):
        if required not in opts:
            raise ConfigError(required, "is missing", "python -m trainer.plan --ngpu N --device-memory GIB "
                              "[config args]")
    ngpu = _number("--ngpu", opts["--ngpu"], int)
    memory = _number("--device-memory", opts["--device-memory"])
    device = opts.get("--device", device_type())
    if device not in ("cuda", "cpu"):
        raise _bad("--device", device, "cuda, cpu")
    skew = _number("--routing-skew", opts.get("--routing-skew", str(DEFAULT_ROUTING_SKEW)), low=0.999999)
    reserve = _number("--reserve-fraction", opts.get("--reserve-fraction", str(DEFAULT_RESERVE)), low=-1e-12)
    if reserve >= 1:
        raise _bad("--reserve-fraction", opts["--reserve-fraction"], "a fraction in [0, 1)")
    top = _number("--top", opts.get("--top", "10"), int)
    if "--nnodes" in opts:
        nnodes = _number("--nnodes", opts["--nnodes"], int)
        if ngpu % nnodes:
            raise _bad("--nnodes", opts["--nnodes"], f"a divisor of --ngpu {ngpu}")
        hw_values.setdefault("gpus_per_node", ngpu // nnodes)
    if "--config" in opts:
        rest = ["--job.config_file", opts["--config"]] + rest
    cfg = load_command_config(rest)
    check_model(cfg)
    hw = Hardware().with_values(**hw_values)
    if "--calibrate-step-s" in opts:
        hw = calibrate(cfg, ngpu, device, skew, hw, _number("--calibrate-step-s", opts["--calibrate-step-s"]))
    start = time.perf_counter()
    result = plan_layouts(cfg, ngpu, memory, device, skew, hw, reserve)
    seconds = time.perf_counter() - start
    if as_json:
        print(json.dumps(result))
    else:
        _print(result, top, seconds)
    if not any(r["fits"] for r in result["layouts"]):
        problem, fixes = nothing_fits(result, cfg)
        print(f"{problem}; what can help: {fixes}", file=sys.stderr)
        raise SystemExit(NOTHING_FITS)


def check_model(cfg: JobConfig) -> None:
    """ConfigError for an unknown model or flavor, before any layout is tried (each would be refused for it)."""
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError:
        raise ConfigError("model.name", f"unknown model {cfg.model.name!r}", ", ".join(available_models())) from None
    plain = dataclasses.replace(cfg, parallelism=ParallelismSection())
    spec.build_args(model_job(plain))


def cli() -> None:
    """The command line: `main` with config errors as one line and exit code 2."""
    run_with_config_errors(main, sys.argv[1:])
