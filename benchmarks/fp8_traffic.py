"""Memory traffic of FP8 quantisation as torch.compile generates it, measured on CPU: inductor's own count of the
bytes each kernel it generates reads and writes, for the routed experts' SwiGLU (the MoE layer's grouped GEMMs,
with the padding to 128-row groups and the gather back) forward and backward, in bf16 and on the real FP8 kernels'
paths: rowwise `torch._scaled_grouped_mm` and blockwise per-expert `scaled_mm`.

    .venv/bin/python benchmarks/fp8_traffic.py                       # 671B's expert widths, 4 experts
    .venv/bin/python benchmarks/fp8_traffic.py --dim 2048 --inter 1408 --experts 8   # 16B's

Why on CPU: the quantisation kernels are memory-bound, so their bytes say what they cost on a GPU, and inductor's
lowering and scheduler decide what is materialised between kernels mostly alike for both devices (the code each
kernel becomes differs; the C++ backend fuses a blockwise tile reduction with its scaling less often than Triton
may). The GEMMs themselves are replaced by opaque ops that
return zeros (torch has no CPU kernel for the FP8 ones, and their traffic is not the quantisation's); their
kernels, and every other op inductor does not generate (a scatter, a copy to the host), are left out of the count.

What the count is: every buffer a generated kernel reads or writes, once per kernel (inductor's
`count_bytes`, the figure its `inductor_metrics` log gives). A GPU kernel that reduces a row and then scales it in
a second loop reads the row twice, where a CPU kernel may hold it in cache: so this is a lower bound of a GPU's
traffic, exact for what is materialised in memory between kernels.

Each recipe is compiled at two row counts (`--rows-per-expert` and twice that): the traffic is linear in the rows,
so the two give the bytes per routed row (activations and their gradients) and the bytes that do not depend on
the rows (the weights: casts, quantisation, gradients). Per quantised operand element, in the planner's count
(`quantization/fp8/accounting.py`: per GEMM 2 (T K + T N) activation and output-gradient elements and 2 N K weight
elements), FP8's extra bytes over bf16 compare with the step-time model's `fp8_quantize_bytes`: 5 by its count (a
read of the bf16 operand for the maxima and one for the scaling, the e4m3 write), 3 by this one (a fused kernel
reads once), 7.2 effective as measured on an H200.

Output: one JSON object: machine, config (shapes), and per recipe: kernels and bytes forward and backward at each
row count, total_bytes (per run), bytes_per_row and weight_bytes (the constant part), and for FP8 extra_bytes (FP8's
total over bf16's, per run), extra_bytes_per_row_element and extra_bytes_per_weight_element (per quantised operand
element), plus `kernels` (the largest generated kernels of the larger run: bytes and the buffers each reads and
writes) with `--kernels N`. Where a pass moved fewer bytes at the larger row count (inductor fused the two runs
otherwise), the split into rows and weights is not derived (`split` says so) and only the totals are given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info  # noqa: E402
from models.deepseek_v3.moe import _experts_grouped_mm  # noqa: E402
from quantization.fp8 import scaled_gemms  # noqa: E402
from quantization.fp8.gemms import _to_host, fp8_grouped_mm  # noqa: E402
from quantization.fp8.kernels import PER_EXPERT, ROWWISE_GROUPED  # noqa: E402
from quantization.fp8.quantize import BLOCK  # noqa: E402

RECIPES = {"none": None, "rowwise": ROWWISE_GROUPED, "blockwise": PER_EXPERT}


def _grouped_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> list[int]:
    """torch._grouped_mm's output shape: [P, N] for a [P, K] x b [E, K, N]; [E, M, N] for a [M, P] x b [P, N]."""
    return [a.shape[0], b.shape[2]] if b.dim() == 3 else [offs.shape[0], a.shape[0], b.shape[1]]


@torch.library.custom_op("fp8_traffic::grouped_mm", mutates_args=())
def _bf16_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Stands for torch._grouped_mm: its output shape, zeros (the traffic counted is everything but the GEMMs)."""
    return a.new_zeros(_grouped_shape(a, b, offs))


@_bf16_gemm.register_fake
def _(a, b, offs):
    return a.new_empty(_grouped_shape(a, b, offs))


def _bf16_gemm_backward(ctx, dy):
    a, b, offs = ctx.saved_tensors  # 2D x 3D only: the bf16 experts' forward GEMMs
    return _bf16_gemm(dy, b.transpose(-2, -1), offs), _bf16_gemm(a.t(), dy, offs), None


_bf16_gemm.register_autograd(_bf16_gemm_backward,
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch.library.custom_op("fp8_traffic::scaled_grouped_mm", mutates_args=())
def _fp8_grouped_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Stands for torch._scaled_grouped_mm (rowwise), as `_bf16_gemm` for torch._grouped_mm."""
    return a.new_zeros(_grouped_shape(a, b, offs), dtype=out_dtype)


@_fp8_grouped_gemm.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype):
    return a.new_empty(_grouped_shape(a, b, offs), dtype=out_dtype)


def _per_expert_zeros(a_q, a_s, b_q, b_s, ends, gemm, out_dtype):
    """Stands for the per-expert scaled_mm loop inside `dsv3_fp8::blockwise_grouped_mm` (already an opaque op)."""
    if gemm == "wgrad":
        return a_q.new_zeros(len(ends), a_q.shape[0], b_q.shape[0], dtype=out_dtype)
    return a_q.new_zeros(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


def _blockwise_mm_zeros(a_q, a_s, b_q, b_s, b_blocks, out_dtype):
    """Stands for F.scaled_mm inside `dsv3_fp8::scaled_mm_blockwise` (already an opaque op)."""
    return a_q.new_zeros(a_q.shape[0], b_q.shape[0], dtype=out_dtype)


def stand_ins() -> list[tuple[object, str, object]]:
    """(owner, attribute, stand-in): torch's FP8 GEMMs as the real-kernel paths call them, replaced by ops of the
    same shapes that return zeros (torch has no CPU kernel for them). Set them with `setattr` (tests: monkeypatch)."""
    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **unused):
        return _fp8_grouped_gemm(a, b, scale_a, scale_b, offs, out_dtype)

    return [(torch, "_scaled_grouped_mm", scaled_grouped_mm), (scaled_gemms, "_per_expert", _per_expert_zeros),
            (scaled_gemms, "_blockwise_scaled_mm", _blockwise_mm_zeros)]


class Experts:
    """The routed experts' grouped GEMM for `recipe` (a `core.quantization.QuantizedGroupedMM`): bf16 through
    `_bf16_gemm`, or `fp8_grouped_mm` on the real kernel's path, with 128-row groups either way so that the
    layouts, and so the bytes outside the GEMMs, differ only by the quantisation."""

    row_align = BLOCK

    def __init__(self, recipe: str):
        self.recipe, self.kernel = recipe, RECIPES[recipe]

    def host_offsets(self, x_PK, w_ENK, offs_E):
        return _to_host(offs_E) if self.kernel == PER_EXPERT else None

    def __call__(self, x_PK, w_ENK, offs_E, host_offs_E=None):
        if self.kernel is None:
            return _bf16_gemm(x_PK, w_ENK.to(x_PK.dtype).transpose(-2, -1), offs_E)
        return fp8_grouped_mm(x_PK, w_ENK, offs_E, self.recipe, self.kernel, host_offs_E)


class SwiGLU(torch.nn.Module):
    """The routed experts with float32 master weights as parameters: torch.compile's partitioner treats parameters
    as free to save for the backward (its `treat_parameters_as_free_to_save`), so what it saves and recomputes is
    what it does in the model."""

    def __init__(self, experts: int, dim: int, inter: int, experts_mm: Experts, counts: torch.Tensor,
                 gen: torch.Generator):
        super().__init__()
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(experts, inter, dim, generator=gen).mul_(0.02))
                            for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, inter, generator=gen).mul_(0.02))
        self.experts_mm, self.counts = experts_mm, counts

    def forward(self, x):
        return _experts_grouped_mm(x, self.w1, self.w2, self.w3, self.counts, padded=True,
                                   quantized_mm=self.experts_mm)


class _Count:
    """Collects inductor's per-kernel byte counts (its `inductor_metrics` artifact, without printing it)."""

    def __enter__(self):
        import torch._inductor.metrics as metrics

        # inductor counts the bytes when this logger takes INFO records; they go nowhere
        log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
        self._saved = log.level, log.handlers, log.propagate
        log.setLevel(logging.INFO)
        log.handlers, log.propagate = [logging.NullHandler()], False
        self.metrics, self.log = metrics, log
        metrics.reset()
        return self

    def take(self) -> list[dict]:
        """The kernels generated since the last take: bytes, and the buffers read and written."""
        from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

        kernels = []
        for node, _ in self.metrics.nodes_num_elem:
            if isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
                continue
            rw = node.read_writes
            kernels.append({"bytes": node.get_read_write_buffers_sizes(), "name": node.get_name(),
                            "reads": sorted(d.name for d in rw.reads), "writes": sorted(d.name for d in rw.writes)})
        self.metrics.reset()
        return kernels

    def __exit__(self, *exc):
        level, self.log.handlers, self.log.propagate = self._saved
        self.log.setLevel(level)


def _measure(recipe: str, rows_per_expert: int, experts: int, dim: int, inter: int, seed: int) -> dict:
    """Compile the experts' SwiGLU for `recipe` at these shapes and count the generated kernels' bytes, forward
    (first call) and backward."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed)
    tokens = rows_per_expert * experts
    # uneven groups, none a multiple of 128, the same at every recipe: the padding is part of the layout
    counts = torch.full((experts,), rows_per_expert, dtype=torch.int64)
    counts[0], counts[-1] = rows_per_expert - 5, rows_per_expert + 5
    x = torch.randn(tokens, dim, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    module = SwiGLU(experts, dim, inter, Experts(recipe), counts, gen)
    compiled = torch.compile(module, fullgraph=True)
    # no cached graphs: a cached graph is not generated again, and only generation counts its bytes (torch's config
    # modules are set through their own patch, which restores them)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), _Count() as count:
        start = time.perf_counter()
        y = compiled(x)
        forward = count.take()
        y.backward(torch.randn(y.shape, generator=gen, dtype=y.dtype))
        backward = count.take()
        seconds = time.perf_counter() - start
    return {"rows": tokens, "compile_and_run_s": round(seconds, 1),
            "forward": {"kernels": len(forward), "bytes": sum(k["bytes"] for k in forward)},
            "backward": {"kernels": len(backward), "bytes": sum(k["bytes"] for k in backward)},
            "largest": sorted(({**k, "pass": p} for p, ks in (("forward", forward), ("backward", backward))
                               for k in ks), key=lambda k: -k["bytes"])}


def _split(runs: list[dict]) -> dict | None:
    """bytes_per_row and weight_bytes (the part that does not grow with the rows) from two runs, or None where a
    pass moved fewer bytes at more rows: inductor then fused the two row counts otherwise, and a line through the
    two totals would not part rows from weights (it once gave FP8 negative bytes per activation element over bf16).
    A pair of runs that grows but fits no line is not caught here."""
    if any(runs[1][p]["bytes"] < runs[0][p]["bytes"] for p in ("forward", "backward")):
        return None
    total = [r["forward"]["bytes"] + r["backward"]["bytes"] for r in runs]
    per_row = (total[1] - total[0]) / (runs[1]["rows"] - runs[0]["rows"])
    return {"bytes_per_row": round(per_row, 1), "weight_bytes": round(total[0] - per_row * runs[0]["rows"])}


def run(args) -> dict:
    """Measure every recipe of `args.recipes` at two row counts; bf16 first, as every FP8 figure is against it."""
    E, K, N = args.experts, args.dim, args.inter
    # the planner's quantised operand elements of the three GEMMs (accounting.py): per routed row 2 (K + N) per
    # GEMM; per pass 2 N K weight elements per GEMM and expert
    row_elements, weight_elements = 3 * 2 * (K + N), 3 * 2 * N * K * E
    results = {}
    for recipe in ["none"] + [r for r in args.recipes if r != "none"]:
        runs = [_measure(recipe, r, E, K, N, args.seed) for r in (args.rows_per_expert, 2 * args.rows_per_expert)]
        total = [r["forward"]["bytes"] + r["backward"]["bytes"] for r in runs]
        split = _split(runs)
        entry = {"runs": [{k: v for k, v in r.items() if k != "largest"} for r in runs], "total_bytes": total,
                 **(split or {"split": "not derived: a pass moved fewer bytes at more rows (inductor fused the two "
                                       "row counts otherwise); compare total_bytes"}),
                 "kernels": runs[1]["largest"][:args.kernels]}
        line = f"{recipe}: {' and '.join(f'{t / 1e6:.1f}' for t in total)} MB at {runs[0]['rows']} and " \
               f"{runs[1]['rows']} rows"
        if split:
            line += f"; {split['bytes_per_row'] / 1e3:.1f} kB per row, {split['weight_bytes'] / 1e6:.1f} MB of " \
                    "weights' traffic"
        if recipe != "none":
            bf16 = results["none"]
            entry["extra_bytes"] = [t - b for t, b in zip(total, bf16["total_bytes"])]
            line += f"; over bf16 {' and '.join(f'{t / 1e6:.1f}' for t in entry['extra_bytes'])} MB"
            if split and "weight_bytes" in bf16:
                entry["extra_bytes_per_row_element"] = round((split["bytes_per_row"] - bf16["bytes_per_row"]) /
                                                             row_elements, 2)
                entry["extra_bytes_per_weight_element"] = round(
                    (split["weight_bytes"] - bf16["weight_bytes"]) / weight_elements, 2)
                line += f", {entry['extra_bytes_per_row_element']} B per activation element, " \
                        f"{entry['extra_bytes_per_weight_element']} B per weight element"
        results[recipe] = entry
        print(line, file=sys.stderr, flush=True)
    return {"machine": machine_info(),
            "config": {"experts": E, "dim": K, "inter": N, "rows_per_expert": [args.rows_per_expert,
                                                                               2 * args.rows_per_expert],
                       "quantised_elements_per_row": row_elements, "quantised_weight_elements": weight_elements},
            "results": results}


def compile_settings() -> list[tuple[object, str, object]]:
    """(owner, attribute, value) that the measurement needs, set like `stand_ins`: no C++ loop split, which asserts
    on the blockwise tilings (torch 2.13, as in `quantize._qdq_op`) and only rewrites a kernel's loops after
    fusion, so the kernels and their bytes stay the same without it."""
    from torch._inductor.codegen.cpp import CppScheduling

    return [(CppScheduling, "try_loop_split", lambda self, nodes: nodes)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dim", type=int, default=7168, help="the model dim (K of w1 and w3)")
    parser.add_argument("--inter", type=int, default=2048, help="the experts' intermediate width")
    parser.add_argument("--rows-per-expert", type=int, default=256, help="the first run's; the second has twice")
    parser.add_argument("--recipes", nargs="+", default=["rowwise", "blockwise"], choices=list(RECIPES))
    parser.add_argument("--kernels", type=int, default=12, help="list this many of the largest kernels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for owner, name, value in stand_ins() + compile_settings():
        setattr(owner, name, value)
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
