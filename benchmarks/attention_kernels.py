"""MLA's causal attention (q/k head dim 192, v 128) on every SDPA kernel, with v as it is and zero-padded to 192.

    python benchmarks/attention_kernels.py                     # 16B shapes: batch 2, 16 heads, seq 4096, bf16
    python benchmarks/attention_kernels.py --batch 4 --seq 2048
    python benchmarks/attention_kernels.py --smoke             # tiny shapes, 1 repeat: what the tests run

FlashAttention needs equal head dims, so MLA's unequal ones send SDPA to another kernel (memory-efficient or cuDNN
on CUDA, math on CPU in fp32); zero-padding v to q/k's head dim and slicing the output is exact and opens the flash
kernel at the cost of 50% more p.v work. Which is faster is a measurement: this script times forward and forward +
backward of `models.deepseek_v3.model.attention` (what the trainer runs: v padded on CPU in bf16, unchanged on
CUDA) and of every SDPA backend forced with `torch.nn.attention.sdpa_kernel`, on v as it is ("unequal") and on v
padded ("padded"), on the device the trainer would choose.

Output: one JSON object on stdout:
  machine   as benchmarks/throughput.py (with the GPU, if any)
  config    batch, heads, seq, qk_head_dim, v_head_dim, dtype, device, repeats, warmup, flops (model FLOPs of
            causal forward + backward: 3 x 2 x B x H x S^2 x (qk + v) / 2, the trainer's count)
  results   per variant ("model", "unequal/<backend>", "padded/<backend>" for backends flash, efficient, cudnn,
            math): forward_ms and forward_backward_ms (median of the timed repeats, each between device
            synchronisations), tflops (flops / forward_backward time), peak_bytes (CUDA: the allocator's peak
            above what was allocated before, forward + backward; null on CPU), max_abs_error (output and input
            gradients against an fp64 math reference on the CPU, the largest over the four, relative to the
            reference's largest magnitude), or error: the one-line reason a variant cannot run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info, synchronize  # noqa: E402  (needs the repo root on sys.path)

BACKENDS = ("flash", "efficient", "cudnn", "math")
SMOKE = dict(batch=1, heads=2, seq=64, qk=24, v=16, repeats=1, warmup=1)


def _variants(attention, F, sdpa_kernel, SDPBackend):
    """{name: fn(q, k, v, scale) -> out} for the model's attention and every backend on unequal and padded v."""
    enum = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}

    def forced(backend, pad):
        def fn(q, k, v, scale):
            dv = v.shape[-1]
            if pad:
                v = F.pad(v, (0, q.shape[-1] - dv))
            with sdpa_kernel([enum[backend]]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return out[..., :dv]
        return fn

    variants = {"model": lambda q, k, v, scale: attention(q, k, v, scale, None)}
    for layout in ("unequal", "padded"):
        for backend in BACKENDS:
            variants[f"{layout}/{backend}"] = forced(backend, layout == "padded")
    return variants


def _median_ms(fn, device, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(batch: int, heads: int, seq: int, qk: int, v: int, repeats: int, warmup: int) -> dict:
    """Time every variant on the trainer's device in bf16; returns the report."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.deepseek_v3.model import attention
    from trainer import device as devices

    device = devices.local_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(batch, heads, seq, d, generator=gen) for d in (qk, qk, v, v)]
    scale = qk ** -0.5
    # the reference: fp64 math on the CPU (causal SDPA of the unpadded tensors)
    ref_in = [t.double().requires_grad_() for t in host[:3]]
    ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=scale)
    ref_out.backward(host[3].double())
    reference = [ref_out.detach()] + [t.grad for t in ref_in]
    q, k, val, grad = (t.to(device, torch.bfloat16) for t in host)
    leaves = [t.clone().requires_grad_() for t in (q, k, val)]
    flops = 3 * 2 * batch * heads * seq * seq * (qk + v) / 2
    results = {}
    for name, fn in _variants(attention, F, sdpa_kernel, SDPBackend).items():
        def forward_backward():
            for t in leaves:
                t.grad = None
            out = fn(*leaves, scale)
            out.backward(grad)
            return out

        try:
            out = forward_backward()
            got = [out.detach()] + [t.grad for t in leaves]
            error = max(((g.double().cpu() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, reference))
            if cuda:
                synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                forward_backward()
                synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) - base
            with torch.no_grad():
                forward_ms = _median_ms(lambda: fn(q, k, val, scale), device, repeats, warmup)
            fwd_bwd_ms = _median_ms(forward_backward, device, repeats, warmup)
        except RuntimeError as e:  # SDPA's "No available kernel" (with the reasons it warned), out of memory
            results[name] = {"error": " ".join(str(e).split())[:300]}
            continue
        results[name] = {"forward_ms": forward_ms, "forward_backward_ms": fwd_bwd_ms,
                         "tflops": flops / (fwd_bwd_ms / 1e3) / 1e12, "peak_bytes": peak if cuda else None,
                         "max_abs_error": error}
    return {"machine": machine_info(),
            "config": {"batch": batch, "heads": heads, "seq": seq, "qk_head_dim": qk, "v_head_dim": v,
                       "dtype": "bfloat16", "device": str(device), "repeats": repeats, "warmup": warmup,
                       "flops": flops},
            "results": results}


def main(argv: list[str] | None = None) -> dict:
    """Parse the flags, run, print the JSON report and return it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--qk", type=int, default=192, help="q/k head dim (qk_nope + qk_rope)")
    parser.add_argument("--v", type=int, default=128, help="v head dim")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: what the tests run")
    args = vars(parser.parse_args(argv))
    if args.pop("smoke"):
        args.update(SMOKE)
    report = run(**args)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
