"""Host time of the blockwise FP8 per-expert GEMM loop (`quantization/fp8/scaled_gemms._per_expert`), measured on
CPU with torch's FP8 GEMM replaced by a no-op: what the loop costs besides its GEMMs, per expert GEMM.

    .venv/bin/python benchmarks/per_expert_host_time.py              # 16 experts, as the 671B-shape benchmark

On a GPU the loop runs inside the opaque op `dsv3_fp8::blockwise_grouped_mm`, right after each MoE layer's forward
reads the group ends on the host (the forward's loops), so the GPU waits for these launches until the host is
ahead again; a GEMM of the 671B benchmark (4096 rows, 7168 x 2048: 120 GFLOP) takes about 0.09 ms at the e4m3
peak measured on an H200. The operands here are small (128 rows per expert, 256 wide): the time is the Python, the
dispatch and any small kernel the loop runs per expert, not bandwidth. One torch thread. A shared machine makes it
noisy: compare runs made one after the other.

Output: one JSON object: machine, config, us_per_expert_gemm (median over the repeats of the loop's time per
expert GEMM, fwd + dgrad + wgrad of one projection) and the repeats' values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info  # noqa: E402
from quantization.fp8 import scaled_gemms  # noqa: E402
from quantization.fp8.quantize import quantize_weight_blocks  # noqa: E402


def measure(experts: int, rows: int, width: int, repeats: int, loops: int) -> list[float]:
    """Microseconds per expert GEMM of each repeat (`loops` passes of fwd, dgrad and wgrad each)."""
    gen = torch.Generator().manual_seed(0)
    P = experts * rows
    x, dy = (torch.randn(P, width, generator=gen).bfloat16() for _ in range(2))
    w = torch.randn(experts, width, width, generator=gen).bfloat16()
    ends = [rows * (e + 1) for e in range(experts)]
    offs = torch.tensor(ends, dtype=torch.int32)
    w_blocks = quantize_weight_blocks(w)
    operands = {gemm: scaled_gemms.quantize_per_expert(a, b, offs, gemm)
                for gemm, a, b in (("fwd", x, w_blocks), ("dgrad", dy, w_blocks.transposed()), ("wgrad", dy, x))}

    def passes(n: int) -> None:
        for _ in range(n):
            for gemm, ops in operands.items():
                scaled_gemms._per_expert(*ops, ends, gemm, torch.bfloat16)

    passes(loops)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        passes(loops)
        times.append((time.perf_counter() - start) / (loops * 3 * experts) * 1e6)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=128, help="rows per expert (a multiple of 128)")
    parser.add_argument("--width", type=int, default=256, help="K and N (multiples of 128)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loops", type=int, default=20, help="passes per repeat")
    args = parser.parse_args(argv)
    threads, real = torch.get_num_threads(), torch._scaled_mm_v2
    torch.set_num_threads(1)
    # no CPU kernel for the blockwise GEMM: a no-op that returns its output
    torch._scaled_mm_v2 = lambda *operands, out=None, **kwargs: out
    try:
        times = measure(args.experts, args.rows, args.width, args.repeats, args.loops)
    finally:
        torch._scaled_mm_v2 = real
        torch.set_num_threads(threads)
    report = {"machine": machine_info(), "config": vars(args),
              "us_per_expert_gemm": round(statistics.median(times), 1), "repeats_us": [round(t, 1) for t in times]}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
