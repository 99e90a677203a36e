"""What torch.compile has to compile for each FP8 recipe: the forward and backward graphs (ATen and custom ops after
AOT autograd) of the dense and the MoE block, traced with the kernels a Hopper GPU gets (`quantization/fp8/
kernels.py`: scaled_mm for blockwise linears, one scaled_mm per expert, `_scaled_grouped_mm` and torchao's
Float8Linear for rowwise), and the time dynamo and AOT autograd took for each, on the CPU.

The model is the 671B-shape benchmark's (train_configs/h100_bench_671b_shapes.json: MLA with q_lora, 16 routed
experts top-8 in groups, a shared expert, one dense layer) with every width cut (`CUT`), so that it traces in a few
seconds on a CPU without a GPU: the graphs' ops are those of the full widths (the same modules convert to FP8; a
width changes no op), and what is measured is tracing, not running. The real FP8 GEMMs have no CPU kernel: each
block runs until its first one, after its graphs are traced.

    python benchmarks/compile_cost.py                              # none, blockwise, rowwise
    python benchmarks/compile_cost.py --recipes none blockwise

Why: on an H200 (2026-11-26) the compiled bf16 run at these shapes compiled in 26 s while the FP8 runs had not
finished compiling after 60 s. Inductor's time (lowering, code generation, the GPU's kernel compiles) is not
measured here: it needs the device, and grows with the ops it lowers, which this counts.

Output (JSON on stdout): model (the cut args), torch, and per recipe: converted (modules converted to FP8) and
blocks {dense, moe}, each with forward_ops, backward_ops, fp8_gemms (how many of them are real FP8 GEMMs), trace_s
(dynamo + AOT autograd, the backward lowered with the forward) and top_ops (the most frequent ops of both graphs);
ops_vs_none: each recipe's ops (forward + backward, both blocks) over recipe none's, and trace_s_vs_none the same
for the tracing time, measured in this run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from models.deepseek_v3.args import ModelArgs  # noqa: E402
from models.deepseek_v3.hf.config import args_from_hf_config_file  # noqa: E402
from models.deepseek_v3.model import DeepSeekV3Model  # noqa: E402
from models.deepseek_v3.parallelize import MODULE_DEFAULTS, compile_model, named_blocks  # noqa: E402
from parallelisms.compile import CompileSection  # noqa: E402
from quantization.fp8 import gemms  # noqa: E402
from quantization.fp8.config import Fp8Section, fp8_selection  # noqa: E402
from quantization.fp8.convert import apply_fp8  # noqa: E402
from quantization.fp8.kernels import Platform  # noqa: E402

RECIPES = ("none", "blockwise", "rowwise")
#: the 671B-shape benchmark's widths cut (dims multiples of 128 where the full ones are, so the same linears
#: convert; wkv_a stays 128 + 64 wide, as 512 + 64 is: not a multiple of 128); layers, experts, routing kept
CUT = dict(dim=512, inter_dim=1024, moe_inter_dim=256, n_heads=4, q_lora_rank=256, kv_lora_rank=128,
           vocab_size=1024)
BATCH, SEQ_LEN = 2, 256
#: the real FP8 GEMMs' ops, as a traced graph names them (the namespace dropped)
FP8_GEMMS = ("scaled_mm_blockwise", "blockwise_grouped_mm", "_scaled_grouped_mm", "_scaled_mm")
#: the platform whose kernels are traced: sm90 with everything torch 2.11+ and torchao offer (DeepGEMM aside)
HOPPER = Platform("cuda", (9, 0), blockwise_scaled_mm=True, scaled_grouped_mm=True, torchao=True,
                  torch_version=torch.__version__)


def _ops(gm: torch.fx.GraphModule) -> Counter:
    """The ATen and custom ops a graph calls, by name."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and
                   isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)))


def trace(recipe: str, args: ModelArgs, batch: int, seq_len: int) -> dict:
    """Trace the first dense and the first MoE block of `args` with `recipe`'s Hopper kernels: modules converted,
    and per block its op counts and tracing time."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    converted = apply_fp8(named_blocks(model), fp8_selection(Fp8Section(recipe=recipe), MODULE_DEFAULTS),
                          platform=HOPPER)
    blocks: dict[str, dict] = {}
    current: dict = {}

    # AOT autograd compilers that count their graph's ops and hand it back to run as it is
    def forward_compiler(gm, inputs):
        current["forward"] = _ops(gm)
        return gm.forward

    def backward_compiler(gm, inputs):
        forward, backward = current["forward"], _ops(gm)
        ops = forward + backward
        blocks[current["kind"]] = {"forward_ops": sum(forward.values()), "backward_ops": sum(backward.values()),
                                   "fp8_gemms": sum(n for op, n in ops.items() if op.split(".")[1] in FP8_GEMMS),
                                   "trace_s": time.perf_counter() - current["t0"],
                                   "top_ops": dict(ops.most_common(8))}
        return gm.forward

    compile_model(model, CompileSection(enable=True, backend=aot_autograd(fw_compiler=forward_compiler,
                                                                           bw_compiler=backward_compiler)))
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    h = torch.randn(batch, seq_len, args.dim, requires_grad=True)
    # the backward is lowered with the forward (not lazily at the first backward); the platform is Hopper's
    # whatever device the tensors are on; bf16 compute, as the trainer's autocast without FSDP
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
            mock.patch.object(gemms, "_platform", lambda platform, x: platform), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        for kind, layer_id in (("dense", 0), ("moe", args.n_dense_layers)):
            current.update(kind=kind, t0=time.perf_counter())
            try:
                model.layers[str(layer_id)](h, cos, sin)
            except (RuntimeError, NotImplementedError, ValueError):
                if recipe == "none":  # no FP8 GEMM to stop at: a real error
                    raise
                # else a real FP8 GEMM, which has no CPU kernel: reached after the tracing
            if kind not in blocks:
                raise RuntimeError(f"recipe {recipe}: the {kind} block traced no backward graph")
    return {"converted": len(converted), "blocks": blocks}


def main(argv: list[str] | None = None) -> dict:
    """Trace every recipe asked for and print (and return) the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    args = parser.parse_args(argv)
    model = args_from_hf_config_file(REPO / "train_configs" / "h100_bench_671b_shapes.json").replace(**CUT)
    recipes = {recipe: trace(recipe, model, BATCH, SEQ_LEN) for recipe in args.recipes}

    def total(result: dict, key: str) -> float:
        return sum(sum(b[k] for k in key.split("+")) for b in result["blocks"].values())

    def vs_none(key: str) -> dict | None:
        return {r: total(result, key) / total(recipes["none"], key) for r, result in recipes.items()} \
            if "none" in recipes else None

    report = {"model": dict(CUT, batch=BATCH, seq_len=SEQ_LEN), "torch": torch.__version__, "recipes": recipes,
              "ops_vs_none": vs_none("forward_ops+backward_ops"), "trace_s_vs_none": vs_none("trace_s")}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
