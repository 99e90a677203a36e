"""Every FP8 GEMM kernel candidate on a CUDA GPU at the 16B and 671B benchmarks' shapes, against bf16 and against the
emulation, so that a GPU session decides `quantization/fp8/kernels.py`'s choices with numbers.

    .venv/bin/python benchmarks/fp8_kernels.py                      # both shape sets, at most --budget-s (60 s)
    .venv/bin/python benchmarks/fp8_kernels.py --shapes 671b --repeats 20 --compile --budget-s 600

On a machine without CUDA it prints one line saying so and exits with code 1 (nothing measured).

Shapes (bf16, tokens = batch 2 x seq 4096): 16b is train_configs/h100_bench.toml's (wq 2048 -> 3072, the issue's
probe 2048 -> 5632; 64 experts of 768 rows, 2048 <-> 1408), 671b is train_configs/h100_bench_671b.toml's (wq_b 1536
-> 24576, wo 16384 -> 7168; 16 experts of 4096 rows, 7168 <-> 2048).

Candidates, each timed forward and forward + backward (median of the timed repeats, CUDA events between device
synchronisations), eager unless marked compiled (`--compile` adds torch.compile'd variants of ours and bf16):
  linear    bf16 (mm), emulated (blockwise and rowwise), scaled_mm blockwise (ours: `Fp8Linear`; "W kept": the
            dgrad takes the forward's e4m3 weight blocks, transposed, as with a weight autocast casts), torchao
            Float8Linear rowwise (what rowwise linears run), torchao Float8BlockwiseLinear (sm90, when importable)
  grouped   bf16 (_grouped_mm), emulated (both recipes), _scaled_grouped_mm rowwise (ours), torchao's rowwise
            _to_fp8_rowwise_then_scaled_grouped_mm, scaled_mm per expert (ours, blockwise; and "W kept"), DeepGEMM
            through torchao (blockwise, when deep_gemm imports)
  kernel    a linear's forward GEMM alone, on operands quantised beforehand: bf16 mm, torch._scaled_mm tensorwise
            and rowwise, F.scaled_mm 1x128 x 128x128 and 1x128 x 1x128
Every fp8 candidate's output and gradients are compared with the emulation of its recipe: rel_vs_emulated is the
normwise relative difference of y, dx and dW (ours and torchao's rowwise ones, with the same power-of-two scales:
bf16 rounding, below 2^-7; torchao's blockwise ones and DeepGEMM quantise with scales amax / 448, so theirs is e4m3
rounding, a few percent). A candidate that cannot run here has `error` (its one-line reason) instead of times. Order:
every shape's bf16, ours and emulated candidates and kernels first (671b before 16b, grouped before linear), then
the optional dependencies' (their Triton kernels compile and autotune on first use); once `--budget-s` is spent the
rest are listed with `error: "skipped: --budget-s spent"` and the report is printed all the same. The budget is
checked between candidates, so one slow candidate can overrun it: a SIGTERM (`timeout`'s, as gpu_session.sh sends at
its step's limit) stops the run where it is and still prints the report of what ran, with `stopped` set and exit
code 124 (on the H200 on 2026-11-27 a run with --budget-s 40 was killed at 75 s without any report). Each GEMM
shape's end is a line on stderr with the seconds so far, so a log says where the time went.

Output: one JSON object on stdout: machine (with the GPU), choice (what kernels.py picks on this GPU for each GEMM
kind), platform (kernels.Platform), config (shapes, repeats, warmup, compile, budget_s), stopped (null, or why the
run ended before every candidate ran), results (one entry per
GEMM shape and candidate: gemm, kind, recipe, candidate, fwd_ms, fwd_bwd_ms, tflops (model FLOPs of fwd + bwd over
fwd_bwd_ms; forward only for kernels), speedup_vs_bf16 (bf16's time over this one's, same measure),
rel_vs_emulated), and fastest (per GEMM shape, recipe and kind, the fastest candidate that matched the emulation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info  # noqa: E402  (needs the repo root on sys.path)

TOKENS = 2 * 4096
#: (name, tokens, in_features, out_features) of the linears; (name, experts, rows per expert, in, out) of the
#: grouped GEMMs
SHAPES = {
    "16b": {"linear": [("wq", TOKENS, 2048, 3072), ("probe", TOKENS, 2048, 5632)],
            "grouped": [("experts.w1", 64, 768, 2048, 1408), ("experts.w2", 64, 768, 1408, 2048)]},
    "671b": {"linear": [("wq_b", TOKENS, 1536, 24576), ("wo", TOKENS, 16384, 7168)],
             "grouped": [("experts.w1", 16, 4096, 7168, 2048), ("experts.w2", 16, 4096, 2048, 7168)]},
}
MATCH = 2.0 ** -7  # ours against the emulation: bf16 rounding
MATCH_OTHER_QUANTISATION = 0.1  # torchao's / DeepGEMM's own scales against the emulation's: e4m3 rounding
SKIPPED = "skipped: --budget-s spent"


class Stopped(BaseException):
    """A SIGTERM arrived while candidates were running. Not an Exception: the `except Exception` that records a
    candidate's own error must let it through."""


@contextlib.contextmanager
def stop_on_sigterm():
    """Within the block, SIGTERM raises `Stopped` (between Python bytecodes: a running CUDA call finishes first);
    the previous handler is restored after it."""
    def handler(signum, frame):
        raise Stopped("SIGTERM (a time limit) before every candidate ran: the missing ones did not run")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, handler)
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _time(fn, repeats: int, warmup: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after `warmup`, each between CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _outputs(fn, x, w, dy):
    """y, dx, dW of y = fn(x, w) with upstream gradient dy."""
    import torch

    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xi, wi)
    dx, dw = torch.autograd.grad(y, [xi, wi], dy)
    return y.detach(), dx, dw


def _measure(fn, x, w, dy, args) -> dict:
    """fwd_ms and fwd_bwd_ms of y = fn(x, w)."""
    import torch

    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()

    def forward():
        with torch.no_grad():
            fn(xi, wi)

    def forward_backward():
        torch.autograd.grad(fn(xi, wi), [xi, wi], dy)
    return {"fwd_ms": _time(forward, args.repeats, args.warmup),
            "fwd_bwd_ms": _time(forward_backward, args.repeats, args.warmup)}


def _linear_candidates(platform) -> dict:
    """{(candidate, recipe): fn(x [M, K], w [N, K]) -> y}."""
    import torch

    from quantization.fp8.gemms import _EMULATED_LINEAR, _Fp8LinearFn
    from quantization.fp8.kernels import blockwise_linear_kernels

    def ours(x, w, weight_cast=False):
        kernels = blockwise_linear_kernels(platform, x.dtype, x.shape[0], x.shape[1], w.shape[0])
        return _Fp8LinearFn.apply(x, w, "blockwise", kernels, weight_cast)

    candidates = {("bf16 mm", "none"): lambda x, w: x @ w.t(),
                  ("emulated", "blockwise"): lambda x, w: _Fp8LinearFn.apply(x, w, "blockwise", _EMULATED_LINEAR),
                  ("emulated", "rowwise"): lambda x, w: _Fp8LinearFn.apply(x, w, "rowwise", _EMULATED_LINEAR),
                  ("scaled_mm blockwise (ours)", "blockwise"): ours,
                  # as with autocast's cast weight (one GPU): the dgrad takes the forward's e4m3 blocks, transposed
                  ("scaled_mm blockwise (ours, W kept)", "blockwise"): lambda x, w: ours(x, w, True)}
    def torchao_rowwise():  # the module convert.py makes, run on the given weight
        from quantization.fp8.convert import _convert_linear

        module = _convert_linear(torch.nn.Linear(128, 128, bias=False, device="meta"), "rowwise", "auto", platform)
        if type(module).__name__ != "Float8Linear":
            raise RuntimeError(f"rowwise linears run {type(module).__name__} here (kernels.rowwise_linear_kernel)")
        return lambda x, w: torch.func.functional_call(module, {"weight": w}, (x,))

    def torchao_blockwise():
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        return lambda x, w: fp8_blockwise_mm.apply(x, w, 128, torch.bfloat16, False)

    candidates[("torchao Float8Linear", "rowwise")] = _optional(torchao_rowwise)
    candidates[("torchao Float8BlockwiseLinear", "blockwise")] = _optional(torchao_blockwise)
    return candidates


def _optional(make):
    """make() (a candidate of an optional dependency), or the exception that says why it cannot run here."""
    try:
        return make()
    except Exception as e:  # ImportError, or the dependency's own error on this machine: reported, not raised
        return e


def _grouped_candidates(platform) -> dict:
    """{(candidate, recipe): fn(x [P, K], w [E, N, K], offs) -> y}."""
    import torch

    from quantization.fp8.gemms import _Fp8GroupedMMFn, fp8_grouped_mm
    from quantization.fp8.kernels import DEEPGEMM, EMULATED, PER_EXPERT, ROWWISE_GROUPED

    candidates = {("bf16 grouped_mm", "none"): lambda x, w, offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)}
    for recipe in ("rowwise", "blockwise"):
        candidates[("emulated", recipe)] = lambda x, w, offs, r=recipe: fp8_grouped_mm(x, w, offs, r, EMULATED)
    candidates[("_scaled_grouped_mm rowwise (ours)", "rowwise")] = \
        lambda x, w, offs: fp8_grouped_mm(x, w, offs, "rowwise", ROWWISE_GROUPED)
    candidates[("scaled_mm per expert (ours)", "blockwise")] = \
        lambda x, w, offs: fp8_grouped_mm(x, w, offs, "blockwise", PER_EXPERT)
    candidates[("scaled_mm per expert (ours, W kept)", "blockwise")] = \
        lambda x, w, offs: _Fp8GroupedMMFn.apply(x, w, offs, "blockwise", PER_EXPERT, None, True)
    def torchao_rowwise():  # needs triton
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        return lambda x, w, offs: _to_fp8_rowwise_then_scaled_grouped_mm(x, w.transpose(-2, -1), offs,
                                                                          pad_token_groups_for_grouped_mm=False)

    def deepgemm():
        if not platform.deep_gemm:
            raise RuntimeError("deep_gemm is not importable with torchao's grouped training kernels here")
        return lambda x, w, offs: fp8_grouped_mm(x, w, offs, "blockwise", DEEPGEMM)

    candidates[("torchao rowwise grouped", "rowwise")] = _optional(torchao_rowwise)
    candidates[("DeepGEMM (torchao)", "blockwise")] = _optional(deepgemm)
    return candidates


def _kernel_candidates() -> dict:
    """{candidate: (prepare(x, w) -> operands, gemm(*operands))}: the GEMM alone, operands quantised beforehand."""
    import torch
    import torch.nn.functional as F

    from quantization.fp8.quantize import BLOCK, quantize_tiles
    from quantization.fp8.scaled_gemms import _mm_scales, _scaled_blockwise

    def tensorwise(x, w):
        sx, sw = (t.abs().amax().float() / 448 for t in (x, w))
        return (x / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn), sx, sw

    def rowwise(x, w):
        (qx, sx), (qw, sw) = quantize_tiles(x, 1, x.shape[1]), quantize_tiles(w, 1, w.shape[1])
        return qx, qw, sx, sw.view(1, -1)

    def blockwise(b_blocks):
        def prepare(x, w):
            qx, sx = quantize_tiles(x, 1, BLOCK)
            qw, sw = quantize_tiles(w, BLOCK, BLOCK) if b_blocks else quantize_tiles(w, 1, BLOCK)
            return (qx, qw, *_mm_scales(sx, sw, b_blocks))
        return prepare

    return {
        "bf16 mm": (lambda x, w: (x, w), lambda x, w: x @ w.t()),
        "torch._scaled_mm tensorwise": (tensorwise, lambda qx, qw, sx, sw: torch._scaled_mm(
            qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)),
        "torch._scaled_mm rowwise": (rowwise, lambda qx, qw, sx, sw: torch._scaled_mm(
            qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)),
        "F.scaled_mm 1x128 x 128x128": (blockwise(True), lambda qx, qw, sx, sw: _scaled_blockwise(
            qx, sx, qw, sw, True, torch.bfloat16)),
        "F.scaled_mm 1x128 x 1x128": (blockwise(False), lambda qx, qw, sx, sw: _scaled_blockwise(
            qx, sx, qw, sw, False, torch.bfloat16)),
    } if hasattr(F, "scaled_mm") else {}


def _linear_job(M: int, K: int, N: int):
    """inputs() -> (x, w, dy, None) of one linear shape, the same values on every call."""
    import torch

    def inputs():
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", generator=gen) * torch.logspace(-1, 1, K, device="cuda")
        w = torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5
        return x.bfloat16(), w.bfloat16(), torch.randn(M, N, device="cuda", generator=gen).bfloat16(), None
    return inputs


def _grouped_job(experts: int, rows: int, K: int, N: int):
    """inputs() -> (x, w, dy, offs) of one grouped shape: equal groups of `rows`."""
    return lambda: _grouped_inputs(experts, rows, K, N)


def _grouped_inputs(experts: int, rows: int, K: int, N: int):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(experts * rows, K, device="cuda", generator=gen) * torch.logspace(-1, 1, K, device="cuda")
    w = torch.randn(experts, N, K, device="cuda", generator=gen) * K ** -0.5
    dy = torch.randn(experts * rows, N, device="cuda", generator=gen)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    return x.bfloat16(), w.bfloat16(), dy.bfloat16(), offs


def _is_optional(name: str) -> bool:
    """Candidates of optional dependencies: timed after every other one (their Triton kernels autotune first)."""
    return name.startswith(("torchao", "DeepGEMM"))


def _run_candidates(gemm: str, kind: str, candidates: dict, x, w, dy, flops: float, args, emulated: dict
                    ) -> list[dict]:
    """Times and errors of the candidates on one GEMM shape (compiled variants of ours and bf16 with --compile);
    `emulated`: the emulation's outputs by recipe, filled on first use (the references of rel_vs_emulated)."""
    import torch

    for (name, recipe), fn in candidates.items():
        if name == "emulated" and recipe not in emulated and time.monotonic() < args.deadline:
            emulated[recipe] = _outputs(fn, x, w, dy)
    variants = [(name, recipe, fn, False) for (name, recipe), fn in candidates.items()]
    if args.compile:
        from parallelisms.compile import EAGER_ROUNDINGS

        # ours compiled as the trainer compiles an FP8 model, bf16 as it compiles a bf16 one
        variants += [(f"{name} compiled", recipe, torch.compile(fn, options=EAGER_ROUNDINGS if "ours" in name
                                                                else None), True)
                     for (name, recipe), fn in candidates.items() if "ours" in name or "bf16" in name]
    results = []
    for name, recipe, fn, compiled in variants:
        row = {"gemm": gemm, "kind": kind, "recipe": recipe, "candidate": name}
        try:
            if time.monotonic() > args.deadline:
                raise TimeoutError(SKIPPED)
            if isinstance(fn, Exception):
                raise fn
            got = _outputs(fn, x, w, dy)
            if recipe in emulated and name != "emulated":
                row["rel_vs_emulated"] = {k: _rel(g, e) for k, g, e in zip(("y", "dx", "dw"), got, emulated[recipe])}
            row.update(_measure(fn, x, w, dy, args))
            row["tflops"] = flops / (row["fwd_bwd_ms"] / 1e3) / 1e12
        except Exception as e:  # a candidate this GPU or this torch cannot run: its reason, and go on
            row["error"] = _reason(e)
        finally:
            if compiled:
                torch._dynamo.reset()
        results.append(row)
    return results


def _speedups(results: list[dict]) -> None:
    """speedup_vs_bf16 of every timed row: bf16's time on the same GEMM shape and measure over the row's."""
    base = {(r["gemm"], r["kind"]): r for r in results if r["candidate"] in ("bf16 mm", "bf16 grouped_mm")}
    for r in results:
        b = base.get((r["gemm"], r["kind"]))
        key = "fwd_ms" if r["kind"] == "kernel" else "fwd_bwd_ms"
        if b is not None and key in b and key in r:
            r["speedup_vs_bf16"] = b[key] / r[key]


def _run_kernels(gemm: str, x, w, args) -> list[dict]:
    import torch

    results = []
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    for name, (prepare, gemm_fn) in _kernel_candidates().items():
        row = {"gemm": gemm, "kind": "kernel", "recipe": None, "candidate": name}
        try:
            if time.monotonic() > args.deadline:
                raise TimeoutError(SKIPPED)
            operands = prepare(x, w)
            row["fwd_ms"] = _time(lambda: gemm_fn(*operands), args.repeats, args.warmup)
            row["tflops"] = flops / (row["fwd_ms"] / 1e3) / 1e12
        except Exception as e:  # as in _run_candidates
            row["error"] = _reason(e)
        results.append(row)
    torch.cuda.empty_cache()
    return results


def _reason(e: Exception) -> str:
    """One line: why a candidate has no times."""
    if isinstance(e, TimeoutError) and str(e) == SKIPPED:
        return SKIPPED
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__


def _fastest(results: list[dict]) -> dict:
    """Per GEMM shape, recipe and kind: the fastest candidate that ran and matched the emulation."""
    best: dict = {}
    for r in results:
        if "fwd_bwd_ms" not in r or r["recipe"] in (None, "none") or r["candidate"] == "emulated":
            continue
        limit = MATCH if "ours" in r["candidate"] else MATCH_OTHER_QUANTISATION
        if "rel_vs_emulated" in r and max(r["rel_vs_emulated"].values()) > limit:
            continue
        key = f"{r['gemm']} {r['kind']} {r['recipe']}"
        if key not in best or r["fwd_bwd_ms"] < best[key]["fwd_bwd_ms"]:
            best[key] = {"candidate": r["candidate"], "fwd_bwd_ms": r["fwd_bwd_ms"],
                         "speedup_vs_bf16": r.get("speedup_vs_bf16")}
    return best


def main(argv: list[str] | None = None) -> dict | None:
    """Run the benchmark; returns the report (None without CUDA, after one line on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="671b,16b", help="comma-separated shape sets, in order: 671b, 16b")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per candidate (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd ours and bf16")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="seconds after which the remaining candidates are skipped (the report still prints)")
    args = parser.parse_args(argv)
    args.start = time.monotonic()
    args.deadline = args.start + args.budget_s
    sets = args.shapes.split(",")
    unknown = [s for s in sets if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; allowed: {', '.join(SHAPES)}")
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/fp8_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured",
              file=sys.stderr)
        return None
    from quantization.fp8.kernels import Platform, blockwise_linear_kernels, grouped_kernel, rowwise_linear_kernel

    platform = Platform.detect("cuda")
    results, emulated, stopped = [], {}, None
    try:
        with stop_on_sigterm():  # from the candidates' imports on (torchao's take ~15 s)
            jobs = _jobs(sets, _linear_candidates(platform), _grouped_candidates(platform))
            _run_jobs(jobs, args, results, emulated)
    except Stopped as e:
        stopped = str(e)
    _speedups(results)
    choice = {"linear rowwise": rowwise_linear_kernel(platform),
              "linear blockwise": vars(blockwise_linear_kernels(platform, torch.bfloat16, TOKENS, 2048, 3072)),
              "grouped rowwise": grouped_kernel(platform, "rowwise", torch.bfloat16, 2048, 1408),
              "grouped blockwise": grouped_kernel(platform, "blockwise", torch.bfloat16, 2048, 1408)}
    report = {"machine": machine_info(), "choice": choice, "platform": vars(platform),
              "config": {"shapes": {s: SHAPES[s] for s in sets}, "repeats": args.repeats, "warmup": args.warmup,
                         "compile": args.compile, "budget_s": args.budget_s, "dtype": "bfloat16"},
              "stopped": stopped, "results": results, "fastest": _fastest(results)}
    print(json.dumps(report, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else str(v)))
    return report


def _jobs(sets: list[str], linears: dict, groups: dict) -> list[tuple]:
    """(gemm, kind, inputs(), candidates, flops) of every shape of `sets`, grouped GEMMs first in each set: the
    blockwise experts' choice is the open one."""
    jobs = []
    for shape_set in sets:
        for name, E, rows, K, N in SHAPES[shape_set]["grouped"]:
            jobs.append((f"{shape_set} {name} {E}x{rows}x{K}x{N}", "grouped", _grouped_job(E, rows, K, N),
                         groups, 6 * E * rows * K * N))
        for name, M, K, N in SHAPES[shape_set]["linear"]:
            jobs.append((f"{shape_set} {name} {M}x{K}x{N}", "linear", _linear_job(M, K, N), linears, 6 * M * K * N))
    return jobs


def _run_jobs(jobs: list, args, results: list[dict], emulated: dict) -> None:
    """Every job's candidates (and a linear's kernels), appended to `results` as they finish: every shape's own
    candidates first, then torchao's and DeepGEMM's. A line on stderr per job with the seconds since the start."""
    import torch

    for optional in (False, True):
        for gemm, kind, inputs, candidates, flops in jobs:
            chosen = {key: fn for key, fn in candidates.items() if _is_optional(key[0]) == optional}
            if not chosen:
                continue
            x, w, dy, extra = inputs()
            if kind == "grouped":
                chosen = {key: fn if isinstance(fn, Exception) else (lambda a, b, f=fn: f(a, b, extra))
                          for key, fn in chosen.items()}
            results += _run_candidates(gemm, kind, chosen, x, w, dy, flops, args, emulated.setdefault(gemm, {}))
            if kind == "linear" and not optional:
                results += _run_kernels(gemm, x, w, args)
            del x, w, dy, extra
            torch.cuda.empty_cache()
            print(f"fp8_kernels: {gemm} {kind}{' (optional dependencies)' if optional else ''} done at "
                  f"{time.monotonic() - args.start:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    report = main()
    sys.exit(1 if report is None else 124 if report["stopped"] else 0)
