"""The MoE-vs-dense benchmark's report: `benchmarks/moe_vs_dense.py --smoke` runs and prints the documented schema.

Only keys, types and the arithmetic of the config are checked, never timings: they depend on the machine and on
what else runs on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIECES = {"router", "dispatch", "experts", "combine", "shared_experts", "other"}


def test_smoke_report_schema():
    r = subprocess.run([sys.executable, "benchmarks/moe_vs_dense.py", "--smoke"], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # stdout holds exactly one JSON object

    assert set(report) == {"machine", "config", "flops_per_token", "routing", "results"}
    assert {"cpu", "cores", "torch_threads", "torch", "load_average_before", "load_average_after"} <= set(
        report["machine"])
    c = report["config"]
    assert c["smoke"] is True and c["fixed_batch"] is False
    assert (c["repeats"], c["warmup"], c["tokens"]) == (1, 1, c["batch"] * c["seq_len"])
    # the dense FFN has the matmul size of the experts a token runs through: routed top-k + shared
    assert c["dense_hidden"] == c["moe_inter_dim"] * (c["n_activated_experts"] + c["n_shared_experts"])
    assert report["flops_per_token"] == {"ffn_matmuls": 18 * c["dim"] * c["dense_hidden"],
                                         "router": 6 * c["dim"] * c["n_routed_experts"]}

    routing = report["routing"]
    assert len(routing["tokens_per_expert"]) == c["n_routed_experts"]
    assert sum(routing["tokens_per_expert"]) == c["tokens"] * c["n_activated_experts"]
    assert 1.0 <= routing["max_over_mean_median"] <= routing["max_over_mean_max"]

    assert set(report["results"]) == {"float32", "bfloat16"}
    for dtype, res in report["results"].items():
        assert set(res) == {"moe_s", "dense_s", "ratio_median", "ratio_min", "moe_breakdown_s",
                            "moe_breakdown_share"}, dtype
        for key in ("moe_s", "dense_s"):
            assert set(res[key]) == {"median", "min", "all"} and len(res[key]["all"]) == 1
            assert all(isinstance(t, float) and t > 0 for t in res[key]["all"])
        assert isinstance(res["ratio_median"], float) and res["ratio_median"] > 0
        assert isinstance(res["ratio_min"], float) and res["ratio_min"] > 0
        split = res["moe_breakdown_s"]
        assert set(split) == PIECES == set(res["moe_breakdown_share"])
        assert all(set(d) == {"forward", "backward"} and min(d.values()) >= 0 for d in split.values())
        # the labels and the backward attribution found the pieces' ops
        for piece in ("router", "dispatch", "experts", "combine", "shared_experts"):
            assert split[piece]["forward"] > 0, (dtype, piece)
        for piece in ("experts", "shared_experts"):
            assert split[piece]["backward"] > 0, (dtype, piece)
        assert abs(sum(res["moe_breakdown_share"].values()) - 1) < 1e-6
