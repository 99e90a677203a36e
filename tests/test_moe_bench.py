"""The MoE-vs-dense benchmark (`benchmarks/moe_vs_dense.py --smoke`): its FLOP counts against the parameters of the
modules it times, its dense FFN against the active expert size, and its summaries against the raw timings.

Timings themselves are never compared with a number: they depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from benchmarks import moe_vs_dense
from models.deepseek_v3.args import FLAVORS
from models.deepseek_v3.moe import FeedForward, MoE

PIECES = ("router", "dispatch", "experts", "combine", "shared_experts", "other")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_smoke_report_against_the_timed_modules(capsys):
    report = moe_vs_dense.main(["--smoke"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))  # stdout: exactly the report
    c = report["config"]
    assert (c["smoke"], c["fixed_batch"], c["repeats"], c["warmup"], c["batch"], c["seq_len"]) == (
        True, False, 1, 1, 8, 4)
    assert c["tokens"] == 8 * 4

    # the modules the smoke run times, rebuilt on meta: FLOPs per token are 6 x the matmul parameters a token uses
    args = FLAVORS["debugmodel"].replace(**moe_vs_dense.SMOKE_ARGS)
    with torch.device("meta"):
        moe = MoE(args, layer_id=args.n_dense_layers)
        dense = FeedForward(args.dim, c["dense_hidden"])
    per_expert = _params(moe.experts) // args.n_routed_experts
    assert _params(dense) == args.n_activated_experts * per_expert + _params(moe.shared_experts)
    assert report["flops_per_token"] == {"ffn_matmuls": 6 * _params(dense), "router": 6 * _params(moe.router)}

    routing = report["routing"]
    counts = routing["tokens_per_expert"]
    assert len(counts) == args.n_routed_experts and sum(counts) == c["tokens"] * args.n_activated_experts
    # one timed batch: its imbalance is both the median and the worst
    imbalance = max(counts) / statistics.mean(counts)
    assert routing["max_over_mean_median"] == pytest.approx(imbalance) == routing["max_over_mean_max"]

    assert sorted(report["results"]) == ["bfloat16", "float32"]
    for dtype, res in report["results"].items():
        (moe_t,), (dense_t,) = res["moe_s"]["all"], res["dense_s"]["all"]
        assert res["moe_s"]["median"] == res["moe_s"]["min"] == moe_t > 0
        assert res["dense_s"]["median"] == res["dense_s"]["min"] == dense_t > 0
        assert res["ratio_median"] == res["ratio_min"] == pytest.approx(moe_t / dense_t)
        split = res["moe_breakdown_s"]
        total = sum(d["forward"] + d["backward"] for d in split.values())
        assert res["moe_breakdown_share"] == pytest.approx(
            {p: (split[p]["forward"] + split[p]["backward"]) / total for p in PIECES})
        # the labels and the backward attribution found each piece's ops
        for piece in ("router", "dispatch", "experts", "combine", "shared_experts"):
            assert split[piece]["forward"] > 0, (dtype, piece)
        for piece in ("experts", "shared_experts"):
            assert split[piece]["backward"] > 0, (dtype, piece)
        assert min(d[k] for d in split.values() for k in ("forward", "backward")) >= 0
