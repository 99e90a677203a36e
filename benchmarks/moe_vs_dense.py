"""One MoE layer against a dense SwiGLU FFN of the same active matmul size: forward + backward time, fp32 and bf16.

    python benchmarks/moe_vs_dense.py                          # debugmodel, batch 4 x seq 256 tokens
    python benchmarks/moe_vs_dense.py --flavor cpu_bench
    python benchmarks/moe_vs_dense.py --repeats 50 --warmup 5  # longer
    python benchmarks/moe_vs_dense.py --fixed_batch            # the same batch every repeat
    python benchmarks/moe_vs_dense.py --smoke                  # tiny layer, 1 repeat: what the tests run

The MoE is `models.deepseek_v3.moe.MoE(args)` as the model builds it for its first MoE layer (training mode, the
flavor's `use_grouped_mm`, local token dispatcher: no expert parallelism), initialised by the model's own rules
(`init_rule` + `init_parameters_`). The dense FFN is `FeedForward(dim, hidden)` with hidden = moe_inter_dim x
(n_activated_experts + n_shared_experts): the same matmul parameters and FLOPs per token as the experts a token
runs through (routed top-k + shared). The router's gate (fp32, dim x n_routed_experts) is the MoE's only extra
matmul; its FLOPs are reported on their own (flops_per_token.router).

One timed repeat is forward + backward of one batch x [batch, seq, dim] (requires_grad) with a given output
gradient; parameter and input gradients are dropped before each repeat, as the trainer's zero_grad does. Every
repeat draws a new random batch (both modules get the same ones), so the routing, and with it every expert's row
count, changes from repeat to repeat as it does from step to step in training: kernels specialised on row counts
pay for that here too. `--fixed_batch` reuses one batch. MoE and dense repeats alternate (MoE, dense, MoE, dense
...) so that load from other processes hits both alike. bf16 is the trainer's: autocast over the forward, fp32
weights.

Output: one JSON object on stdout:
  machine   CPU model, cores, torch threads, torch version, load average before and after the run
  config    flavor, batch, seq_len, tokens, dim, n_routed_experts, n_activated_experts, n_shared_experts,
            moe_inter_dim, dense_hidden, use_grouped_mm, repeats, warmup, fixed_batch, smoke
  flops_per_token   forward + backward model FLOPs per token: ffn_matmuls (dense FFN = routed top-k + shared
            experts, 6 x 3 x dim x dense_hidden) and router (the extra fp32 gate, 6 x dim x n_routed_experts)
  routing   tokens per expert of the timed batches (grouped GEMM efficiency depends on the imbalance):
            tokens_per_expert (first timed batch, a list), max_over_mean_median and max_over_mean_max (max / mean
            tokens per expert of each timed batch, median and worst over the batches)
  results   per dtype ("float32", "bfloat16"):
    moe_s, dense_s    forward + backward seconds: median, min, all (every timed repeat)
    ratio_median      moe_s.median / dense_s.median (the issue's target: <= 1.3)
    ratio_min         moe_s.min / dense_s.min
    moe_breakdown_s   a profiled MoE forward + backward (first timed batch) after the timed ones: self CPU
                      seconds per piece and direction, {piece: {"forward": s, "backward": s}} for router,
                      dispatch (permutation to the grouped layout), experts (grouped expert GEMMs with their casts
                      and row alignment), combine (back to token order, sum over top-k), shared_experts, other
                      (MoE.forward's glue: token counts, routing weight multiply, reshapes; gradient accumulation)
    moe_breakdown_share   each piece's share of the profiled total (forward + backward)

Breakdown method: `torch.profiler` (CPU) with `record_function` labels put around the pieces of this MoE instance
(router, dispatcher.dispatch, experts, dispatcher.combine, shared_experts, MoE.forward). A forward op's self time
goes to its innermost label; a backward node runs in the autograd engine and carries the sequence number of the
forward op that created it, so its time goes to that op's piece. It is CPU time of the launching thread, so with
intra-op threads it splits wall time; the profiler's own overhead makes the total larger than moe_s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import labelled, machine_info  # noqa: E402  (needs the repo root on sys.path)

PIECES = ("router", "dispatch", "experts", "combine", "shared_experts", "other")
DTYPES = ("float32", "bfloat16")
# --smoke: the debug flavor cut to width 64, 8 x 4 tokens
SMOKE_ARGS = dict(dim=64, moe_inter_dim=32)


def build(args, seed: int = 0):
    """(MoE, dense FeedForward) initialised by the model's own rules, as layer `n_dense_layers` would be."""
    import torch
    from models.common.init import init_parameters_
    from models.deepseek_v3.model import init_rule
    from models.deepseek_v3.moe import MoE, FeedForward

    layer = args.n_dense_layers
    moe = MoE(args, layer_id=layer)
    dense = FeedForward(args.dim, args.moe_inter_dim * (args.n_activated_experts + args.n_shared_experts))
    fqns = [(f"{prefix}.{name}", param) for prefix, module in ((f"layers.{layer}.moe", moe),
                                                               (f"layers.{layer}.feed_forward", dense))
            for name, param in module.named_parameters()]
    init_parameters_(((fqn, param, init_rule(args, fqn)) for fqn, param in fqns), seed)
    moe.reset_buffers(torch.device("cpu"))
    return moe.train(), dense.train()


def _fwd_bwd(module, x, grad, dtype) -> None:
    import torch

    module.zero_grad(set_to_none=True)
    x.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    with ctx:
        out = module(x)
    out.backward(grad)


def time_pair(moe, dense, batches: list, dtype: str, warmup: int) -> tuple[list[float], list[float]]:
    """Interleaved forward + backward timings (seconds) of the MoE and the dense FFN, one per (x, grad) of
    `batches` after the first `warmup`."""
    times = {id(moe): [], id(dense): []}
    for i, (x, grad) in enumerate(batches):
        for module in (moe, dense):
            t0 = time.perf_counter()
            _fwd_bwd(module, x, grad, dtype)
            if i >= warmup:
                times[id(module)].append(time.perf_counter() - t0)
    return times[id(moe)], times[id(dense)]


@contextlib.contextmanager
def _instrumented(moe):
    """Label the MoE's pieces for the profiler on this instance only (behaviour unchanged); undone on exit."""
    targets = [(moe, "forward", "other"), (moe.router, "forward", "router"),
               (moe.dispatcher, "dispatch", "dispatch"), (moe.experts, "forward", "experts"),
               (moe.dispatcher, "combine", "combine")]
    if moe.shared_experts is not None:
        targets.append((moe.shared_experts, "forward", "shared_experts"))
    for obj, attr, piece in targets:
        setattr(obj, attr, labelled(f"piece/{piece}", getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, _ in targets:
            delattr(obj, attr)  # the instance attribute shadowed the class's method


def _label_of(event) -> str | None:
    while event is not None:
        if event.name.startswith("piece/"):
            return event.name[len("piece/"):]
        event = event.cpu_parent
    return None


def _engine_node(event):
    """The autograd engine's event for the backward node `event` runs in, or None for a forward event."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return event
        event = event.cpu_parent
    return None


def breakdown(events) -> dict[str, dict[str, float]]:
    """Self CPU seconds per piece and direction (see the module docstring)."""
    split = {piece: {"forward": 0.0, "backward": 0.0} for piece in PIECES}
    engine_of = {id(event): _engine_node(event) for event in events}
    piece_of_seq: dict[int, str] = {}
    # a forward op sees the sequence number the next autograd node will get: the last one to see it made the node
    for event in sorted(events, key=lambda e: e.time_range.start):
        if engine_of[id(event)] is None and event.sequence_nr >= 0:
            piece_of_seq[event.sequence_nr] = _label_of(event) or "other"
    for event in events:
        engine = engine_of[id(event)]
        if engine is not None:
            split[piece_of_seq.get(engine.sequence_nr, "other")]["backward"] += event.self_cpu_time_total / 1e6
        else:
            split[_label_of(event) or "other"]["forward"] += event.self_cpu_time_total / 1e6
    return split


def profile_moe(moe, x, grad, dtype: str) -> dict[str, dict[str, float]]:
    """Breakdown of one MoE forward + backward: the second of two profiled ones (the first profile in a process
    charges a few ms of the profiler's own start-up to the first label)."""
    from torch.profiler import ProfilerActivity, profile

    with _instrumented(moe):
        for _ in range(2):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _fwd_bwd(moe, x, grad, dtype)
    return breakdown(prof.events())


def _summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "all": times}


def run(flavor: str, batch: int, seq_len: int, repeats: int, warmup: int, fixed_batch: bool, smoke: bool) -> dict:
    """Build, time and profile; returns the report."""
    import torch
    from models.deepseek_v3.args import FLAVORS

    machine = machine_info()
    args = FLAVORS[flavor].replace(**SMOKE_ARGS) if smoke else FLAVORS[flavor]
    moe, dense = build(args)
    hidden = dense.w1.out_features
    gen = torch.Generator().manual_seed(1)
    distinct = [(torch.randn(batch, seq_len, args.dim, generator=gen).requires_grad_(),
                 torch.randn(batch, seq_len, args.dim, generator=gen))
                for _ in range(1 if fixed_batch else warmup + repeats)]
    batches = [distinct[i % len(distinct)] for i in range(warmup + repeats)]
    timed = batches[warmup:]
    counts = []
    with torch.no_grad():
        for x, _ in distinct if fixed_batch else timed:
            _, idx, _ = moe.router(x.view(-1, args.dim), moe.expert_bias)
            counts.append(torch.bincount(idx.flatten(), minlength=args.n_routed_experts))
    imbalance = [(c.max() / c.float().mean()).item() for c in counts]

    results = {}
    for dtype in DTYPES:
        moe_t, dense_t = time_pair(moe, dense, batches, dtype, warmup)
        split = profile_moe(moe, *timed[0], dtype)
        total = sum(d["forward"] + d["backward"] for d in split.values())
        results[dtype] = {
            "moe_s": _summary(moe_t), "dense_s": _summary(dense_t),
            "ratio_median": statistics.median(moe_t) / statistics.median(dense_t),
            "ratio_min": min(moe_t) / min(dense_t),
            "moe_breakdown_s": split,
            "moe_breakdown_share": {p: (d["forward"] + d["backward"]) / total for p, d in split.items()},
        }
    machine["load_average_after"] = os.getloadavg()
    return {
        "machine": machine,
        "config": {"flavor": flavor, "batch": batch, "seq_len": seq_len, "tokens": batch * seq_len, "dim": args.dim,
                   "n_routed_experts": args.n_routed_experts, "n_activated_experts": args.n_activated_experts,
                   "n_shared_experts": args.n_shared_experts, "moe_inter_dim": args.moe_inter_dim,
                   "dense_hidden": hidden, "use_grouped_mm": args.use_grouped_mm, "repeats": repeats,
                   "warmup": warmup, "fixed_batch": fixed_batch, "smoke": smoke},
        "flops_per_token": {"ffn_matmuls": 6 * 3 * args.dim * hidden, "router": 6 * args.dim * args.n_routed_experts},
        "routing": {"tokens_per_expert": counts[0].tolist(), "max_over_mean_median": statistics.median(imbalance),
                    "max_over_mean_max": max(imbalance)},
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run the benchmark and print (and return) the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="model flavor (models/deepseek_v3/args.py)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30, help="timed forward + backward passes of each module")
    parser.add_argument("--warmup", type=int, default=5, help="untimed passes of each module first")
    parser.add_argument("--fixed_batch", action="store_true", help="the same batch every repeat (fixed routing)")
    parser.add_argument("--smoke", action="store_true", help="width-64 layer, 8 x 4 tokens, 1 repeat, 1 warm-up")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.seq_len, args.repeats, args.warmup = 8, 4, 1, 1
    report = run(args.flavor, args.batch, args.seq_len, args.repeats, args.warmup, args.fixed_batch, args.smoke)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
