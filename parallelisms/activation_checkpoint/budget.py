"""Activation checkpointing by memory budget (`mode = "budget"`): the choice per block as the config writes it, and
the solver that makes it.

Each block gets one of: no AC (`none`), a full checkpoint (`full`), or per-op selective AC that saves the outputs of
a set of op-table names and recomputes the rest (`op`). `per_layer` writes the choice as one entry per layer:
`3=none`, `3=full`, `3=mm+grouped_mm+topk`.

The solver is generic. The memory plan (`trainer/tools/memory_plan.py`) supplies each block's forward tensors
(`core.memory_types.Item`: bytes, producing op, FLOPs), the bytes a choice keeps after forward and rebuilds in its
backward, the seconds recomputing a tensor costs (the step-time model), and the planned peak of each pipeline rank
for a whole choice. `choose` returns the choice of least predicted recompute time whose planned peak fits the budget
on every rank:

1. options, per block: none, full, and op(S) for every non-empty subset S of the ops its tensors come from, less
   those another option beats in all of recompute seconds, bytes kept after forward and bytes held during its own
   backward (kept + rebuilt): the plan's peak grows with both byte counts. Options within 1% of the block's range
   of a simpler one count as beaten (`TOLERANCE`): saving the top-k indices alone is no option next to full AC.
2. a first choice, greedily (a multiple-choice knapsack on convex hulls): per block the lower convex hull of its
   options in (seconds, bytes kept), a chain from none to full along which every step saves fewer bytes per added
   second than the one before; the steps of all chains, merged by bytes saved per second (ties: the lower layer
   first, whose bytes are held during every later block's backward), are taken until the planned peak fits; then
   each block, the most expensive first, steps back along its chain while the peak still fits.
3. the exact choice, per pipeline rank (each rank's peak depends on its own blocks only), by dynamic programming
   over the rank's blocks in order: a partial choice stays while the peak fits with the undecided blocks fully
   checkpointed (the least they can hold), and of two partial choices the one keeping more bytes for more seconds
   goes, because the plan's phases depend on the blocks before a given one only through the sum of the bytes they
   keep; partial choices no cheaper than step 2's are dropped. It stops, keeping step 2's choice, after
   `MAX_EVALUATIONS` planned peaks.

On the debug model step 3 finds the optimum of the plan (an exhaustive branch and bound agrees, benchmarks/
ac_budget.py --optimality), where step 2 alone recomputed up to 2x as long. The layout planner, which asks for
thousands of layouts, runs step 2 only, bisecting for the fitting prefix (`quick`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

from core.memory_types import Item
from parallelisms.moe_comm.registry import op_table

__all__ = ["BudgetResult", "LayerChoice", "Option", "block_options", "choose", "parse_per_layer",
           "per_layer_entries"]

NONE, FULL, OP = "none", "full", "op"


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """What AC does to one block: `mode` none, full, or op (save the outputs of `save_ops`, recompute the rest)."""

    mode: str
    save_ops: tuple[str, ...] = ()

    def text(self) -> str:
        """The choice as a `per_layer` entry writes it after `=`."""
        return "+".join(self.save_ops) if self.mode == OP else self.mode


def parse_per_layer(entries: Sequence[str]) -> dict[int, LayerChoice]:
    """`activation_checkpoint.per_layer` as {layer id: choice}; ValueError naming the first bad entry."""
    table = op_table()
    choices: dict[int, LayerChoice] = {}
    for entry in entries:
        layer, sep, what = (part.strip() for part in entry.partition("="))
        if not sep or not layer.isdigit():
            raise ValueError(f"{entry!r} is not layer=choice")
        if int(layer) in choices:
            raise ValueError(f"layer {int(layer)} has two entries")
        if what in (NONE, FULL):
            choices[int(layer)] = LayerChoice(what)
            continue
        ops = tuple(op.strip() for op in what.split("+"))
        unknown = [op for op in ops if op not in table]
        if not what:
            raise ValueError(f"{entry!r}: no choice after '='")
        if unknown:
            raise ValueError(f"{entry!r}: {', '.join(map(repr, unknown))} after '=' is neither none, full nor an op "
                             "name")
        choices[int(layer)] = LayerChoice(OP, ops)
    return choices


def per_layer_entries(choices: Mapping[int, LayerChoice]) -> list[str]:
    """The `per_layer` entries of `choices`, by layer id."""
    return [f"{layer}={choice.text()}" for layer, choice in sorted(choices.items())]


#: Step 1 treats options within this share of a block's range as equal (see `block_options`).
TOLERANCE = 0.01


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice for one block: the bytes it keeps after forward, the bytes its backward holds at once (kept and
    rebuilt), and its predicted recompute seconds."""

    choice: LayerChoice
    kept: int
    held: int
    seconds: float


def block_options(items: Sequence[Item], names: Mapping[str, tuple[str, ...]],
                  memory: Callable[[str, frozenset[str]], tuple[int, int]],
                  item_seconds: Callable[[Item], float]) -> list[Option]:
    """The options of one block (step 1 of the module docstring), cheapest first.

    items: the block's forward tensors; names: each op the tensors are labelled with (`Item.op`) that a policy can
    save -> the op-table names that save it in this run (a comm backend's own ops for the token exchange);
    memory(mode, ops): (bytes kept after forward, bytes rebuilt in backward) under mode none, full, or op saving the
    tensors labelled `ops` (under op, each the sum of what saving each op alone adds); item_seconds: what
    recomputing one tensor costs.
    """
    ops = sorted({item.op for item in items} & set(names))
    seconds = dict.fromkeys(ops, 0.0)
    total = 0.0
    for item in items:
        if item.op != "input":
            cost = item_seconds(item)
            total += cost
            if item.op in seconds:
                seconds[item.op] += cost
    base = memory(OP, frozenset())
    adds = {op: [a - b for a, b in zip(memory(OP, frozenset({op})), base)] for op in ops}
    found = []
    for mode, cost in ((NONE, 0.0), (FULL, total)):
        kept, rebuilt = memory(mode, frozenset())
        found.append(Option(LayerChoice(mode), kept, kept + rebuilt, cost))
    for size in range(1, len(ops) + 1):
        for subset in itertools.combinations(ops, size):
            kept = base[0] + sum(adds[op][0] for op in subset)
            rebuilt = base[1] + sum(adds[op][1] for op in subset)
            save_ops = tuple(dict.fromkeys(name for op in subset for name in names[op]))
            found.append(Option(LayerChoice(OP, save_ops), kept, kept + rebuilt,
                                total - sum(seconds[op] for op in subset)))
    # An option goes when one already kept is no worse by more than TOLERANCE of the block's range (its seconds
    # under full AC, its bytes without AC) in each of the three: the simplest first (none, full, then the fewest
    # saved ops), so that an op set saving a few bytes over full AC (its top-k indices, say) is no choice of its own.
    seconds_slack, bytes_slack = TOLERANCE * total, TOLERANCE * found[0].held
    found.sort(key=lambda o: (o.choice.mode == OP, len(o.choice.save_ops), o.seconds))
    options: list[Option] = []
    for option in found:
        if not any(o.seconds <= option.seconds + seconds_slack and o.kept <= option.kept + bytes_slack
                   and o.held <= option.held + bytes_slack for o in options):
            options.append(option)
    return sorted(options, key=lambda o: (o.seconds, o.kept, o.held))


def _saved_per_second(a: Option, b: Option) -> float:
    """Bytes kept after forward that stepping from `a` to `b` saves, per added second of recompute."""
    added = b.seconds - a.seconds
    return float("inf") if added <= 0 else (a.kept - b.kept) / added


def _hull(options: Sequence[Option]) -> list[Option]:
    """The lower convex hull of `options` (cheapest first) in (seconds, kept): step 2's chain."""
    pareto: list[Option] = []
    for option in options:
        if not pareto or option.kept < pareto[-1].kept:
            pareto.append(option)
    hull: list[Option] = []
    for option in pareto:
        while len(hull) >= 2 and _saved_per_second(hull[-2], hull[-1]) <= _saved_per_second(hull[-1], option):
            hull.pop()
        hull.append(option)
    return hull


@dataclasses.dataclass(frozen=True)
class BudgetResult:
    """What `choose` found: the choice per layer, its planned peak in bytes (the worst rank's) and predicted
    recompute seconds, and whether it fits; when not even full AC fits, `choices` are full AC's, with the least
    planned peak. `exact`: step 3 finished (the optimum of the plan), else step 2's choice."""

    choices: dict[int, LayerChoice]
    peak: int
    seconds: float
    fits: bool
    exact: bool = False


#: Planned peaks step 3 may evaluate per pipeline rank before it keeps step 2's choice.
MAX_EVALUATIONS = 50_000


def choose(ranks: Sequence[Sequence[int]], options: Mapping[int, Sequence[Option]],
           peak: Callable[[int, Mapping[int, LayerChoice]], int], budget: int, quick: bool = False) -> BudgetResult:
    """The choice per layer of least predicted recompute seconds whose planned peak is at most `budget` bytes on
    every pipeline rank (steps 2 and 3 of the module docstring).

    ranks: each pipeline rank's layers, in the order its plan lists its blocks; options: each layer's
    `block_options`; peak(r, choices): the planned peak of rank r (index into `ranks`) under `choices` (its own
    layers' are read). `quick`: step 2 only, bisecting the merged steps for a fitting prefix (the peak falls
    along them, though not strictly), without stepping back.
    """
    chains = {layer: _hull(opts) for layer, opts in options.items()}
    least = {layer: chain[-1] for layer, chain in chains.items()}  # full AC: least kept and held
    greedy = _greedy(chains, lambda c: max(peak(r, c) for r in range(len(ranks))), budget, quick)
    if quick or not greedy.fits:
        return greedy
    choices, exact = dict(greedy.choices), True
    for r, layers in enumerate(ranks):
        incumbent = sum(_seconds(options[layer], greedy.choices[layer]) for layer in layers)
        found = _exact(layers, options, least, lambda c, r=r: peak(r, c), budget, incumbent)
        if found is None:
            exact = False
        else:
            choices.update(found)
    seconds = sum(_seconds(options[layer], choice) for layer, choice in choices.items())
    return BudgetResult(choices, max(peak(r, choices) for r in range(len(ranks))), seconds, True, exact)


def _seconds(options: Sequence[Option], choice: LayerChoice) -> float:
    return next(o.seconds for o in options if o.choice == choice)


def _exact(layers: Sequence[int], options: Mapping[int, Sequence[Option]], least: Mapping[int, Option],
           peak: Callable[[Mapping[int, LayerChoice]], int], budget: int, incumbent: float
           ) -> dict[int, LayerChoice] | None:
    """Step 3 for one rank: its layers' cheapest choice that fits, if cheaper than `incumbent` seconds ({} when
    step 2's is already the cheapest); None when it ran out of evaluations."""
    # (bytes the decided blocks keep, their seconds, their options)
    states: list[tuple[int, float, tuple[Option, ...]]] = [(0, 0.0, ())]
    evaluations = 0
    for k, layer in enumerate(layers):
        grown = []
        for kept, seconds, chosen in states:
            for option in options[layer]:  # cheapest first
                if seconds + option.seconds >= incumbent:
                    break
                choices = {l: o.choice for l, o in zip(layers, chosen + (option,))}
                choices.update({l: least[l].choice for l in layers[k + 1:]})
                evaluations += 1
                if evaluations > MAX_EVALUATIONS:
                    return None
                if peak(choices) <= budget:
                    grown.append((kept + option.kept, seconds + option.seconds, chosen + (option,)))
        grown.sort(key=lambda s: (s[0], s[1]))
        states = []
        for state in grown:
            if not states or state[1] < states[-1][1]:
                states.append(state)
    if not states:
        return {}
    best = min(states, key=lambda s: s[1])
    return {l: o.choice for l, o in zip(layers, best[2])}


def _after(chains: Mapping[int, Sequence[Option]], steps: Sequence[tuple[float, int, int]]) -> dict[int, int]:
    """Each layer's position along its chain once `steps` (saved per second, layer, position) are taken."""
    position = dict.fromkeys(chains, 0)
    for _, layer, k in steps:
        position[layer] = max(position[layer], k + 1)
    return position


def _greedy(chains: Mapping[int, Sequence[Option]], peak: Callable[[dict[int, LayerChoice]], int], budget: int,
            quick: bool) -> BudgetResult:
    """Step 2: the convex-hull greedy, then the step back (not when `quick`)."""
    position = {layer: len(chain) - 1 for layer, chain in chains.items()}

    def state() -> dict[int, LayerChoice]:
        return {layer: chains[layer][k].choice for layer, k in position.items()}

    def result(planned: int, fits: bool) -> BudgetResult:
        seconds = sum(chains[layer][k].seconds for layer, k in position.items())
        return BudgetResult(state(), planned, seconds, fits)

    planned = peak(state())
    if planned > budget:  # not even the least planned peak
        return result(planned, False)
    steps = sorted(((_saved_per_second(chain[k], chain[k + 1]), layer, k) for layer, chain in chains.items()
                    for k in range(len(chain) - 1)), key=lambda s: (-s[0], s[1], s[2]))
    position = dict.fromkeys(chains, 0)
    planned = peak(state())
    if quick and planned > budget:
        low, high = 0, len(steps)  # the prefix of `low` steps does not fit, that of `high` does (full AC)
        while high - low > 1:
            middle = (low + high) // 2
            position = _after(chains, steps[:middle])
            if peak(state()) <= budget:
                high = middle
            else:
                low = middle
        position = _after(chains, steps[:high])
        return result(peak(state()), True)
    for _, layer, k in steps:
        if planned <= budget:
            break
        position[layer] = k + 1
        planned = peak(state())
    if not quick:
        for layer in sorted(chains, key=lambda l: (-chains[l][position[l]].seconds, l)):
            while position[layer] > 0:
                position[layer] -= 1
                lower = peak(state())
                if lower > budget:
                    position[layer] += 1
                    break
                planned = lower
    return result(planned, True)
