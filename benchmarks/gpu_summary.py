"""The short table `benchmarks/gpu_session.sh` writes last: one row per throughput report in its output folder, the
issue-34 targets checked against them, and the test and kernel-check results.

    python benchmarks/gpu_summary.py outputs/gpu_session          # markdown on stdout

Rows: the variant (the report's file name), tokens/s timed step by step (a synchronisation around each step) and
free-running (as training runs), MFU of each, the peak of allocated memory, where the profiled step's GPU time
went (optimizer kernels, idle, and the idle's three largest parts by what the host was doing: the phase whose
launch ended each gap, `benchmarks/throughput.py`'s idle_by_host) and the time torch.compile took; then per
run the three (phase, launching op) pairs with the most idle time. Targets, each PASS / FAIL / not run; for a variant
without a report (stopped at its time limit, say), what its log says it had compiled (the trainer's torch.compile
lines, `trainer/compile_times.py`):
  - at the 671B GEMM shapes, compiled: FP8 blockwise and rowwise free-running tokens/s >= 1.15x bf16's
  - at the 16B shapes (h100_bench.toml), compiled: batch 4 free-running MFU >= 55%, batch 2 >= 50%
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

#: (target, numerator report, denominator report or None, threshold): a ratio of free-running tokens/s, or an MFU
TARGETS = (
    ("671B shapes: FP8 blockwise / bf16 tokens/s >= 1.15", "b671_fp8_blockwise", "b671_bf16", 1.15),
    ("671B shapes: FP8 rowwise / bf16 tokens/s >= 1.15", "b671_fp8_rowwise", "b671_bf16", 1.15),
    ("16B shapes, compiled B4: MFU >= 55%", "b16_b4", None, 0.55),
    ("16B shapes, compiled B2: MFU >= 50%", "b16_b2", None, 0.50),
)


def load_reports(folder: str) -> dict[str, dict]:
    """Name -> throughput report, for every `<name>.json` in `folder` that is one (other JSON files are skipped)."""
    reports = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and "free_running" in report:
            reports[os.path.basename(path)[:-len(".json")]] = report
    return reports


def _ms(split: dict | None, key: str) -> str:
    if not split:
        return "-"
    value = split["idle_s"] if key == "idle" else split["kernel_s"].get(key)
    return "-" if value is None else f"{value * 1e3:.1f}"


def _idle_by_host(split: dict | None) -> dict:
    """A report's `gpu_time_split.idle_by_host`, empty where the report has none (CPU, older reports)."""
    return (split or {}).get("idle_by_host") or {}


def _idle_parts(split: dict | None) -> str:
    """The three largest nonzero parts of the idle time by host phase, "phase ms" each."""
    parts = _idle_by_host(split).get("by_phase_s", {})
    ranked = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)[:3]
    return ", ".join(f"{k} {v * 1e3:.1f}" for v, k in ranked) or "-"


def rows(reports: dict[str, dict]) -> list[str]:
    """The markdown table of the reports."""
    lines = ["| variant | tokens/s timed | tokens/s free | MFU timed | MFU free | peak GiB | optimizer ms | idle ms "
             "| idle by host phase ms | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        free, split = r["free_running"], r.get("gpu_time_split")
        peak, compiled = r.get("peak_memory_bytes"), (r.get("compile_time") or {}).get("seconds")
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {free['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{free['mfu']:.1%} | {'-' if peak is None else f'{peak / 2**30:.2f}'} | "
                     f"{_ms(split, 'optimizer')} | {_ms(split, 'idle')} | {_idle_parts(split)} | "
                     f"{'-' if compiled is None else f'{compiled:.1f}'} |")
    return lines


#: the trainer's line after each compile (trainer/compile_times.py)
_COMPILE_LINE = re.compile(r"torch\.compile: (.+) compiled in ([0-9.]+) s \((\d+) compiles, ([0-9.]+) s so far\)")


def compile_progress(folder: str, name: str) -> str | None:
    """What the log `<name>.log` in `folder` says was compiled: the count, the seconds and the slowest compile;
    None without such lines."""
    try:
        with open(os.path.join(folder, f"{name}.log")) as f:
            found = [m for m in map(_COMPILE_LINE.search, f) if m]
    except OSError:
        return None
    if not found:
        return None
    slowest = max(found, key=lambda m: float(m.group(2)))
    return f"its log: {found[-1].group(3)} compiles done in {float(found[-1].group(4)):.1f} s, the slowest " \
           f"{slowest.group(1)} ({float(slowest.group(2)):.1f} s)"


def targets(reports: dict[str, dict], folder: str) -> list[str]:
    """One line per target: its measured value and PASS / FAIL, or why it was not checked (with what the missing
    variants' logs say they compiled)."""
    lines = []
    for label, name, base, threshold in TARGETS:
        missing = [n for n in (name, base) if n is not None and n not in reports]
        if missing:
            said = [f"{n}: {progress}" for n in missing if (progress := compile_progress(folder, n))]
            lines.append(f"- {label}: not run ({', '.join(missing)} missing" + "".join(f"; {s}" for s in said) + ")")
            continue
        value = reports[name]["free_running"]["tokens_per_s"] / reports[base]["free_running"]["tokens_per_s"] \
            if base is not None else reports[name]["free_running"]["mfu"]
        shown = f"{value:.2f}x" if base is not None else f"{value:.1%}"
        lines.append(f"- {label}: {shown} {'PASS' if value >= threshold else 'FAIL'}")
    return lines


def tests(folder: str) -> list[str]:
    """Each pytest junit XML in `folder`: tests, failures, errors, skipped."""
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "*.xml"))):
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            lines.append(f"- {os.path.basename(path)}: unreadable")
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        lines.append(f"- {os.path.basename(path)}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return lines


def idle_ops(reports: dict[str, dict], top: int = 3) -> list[str]:
    """Per report, the (phase, launching op) pairs that left the GPU idle longest in the profiled step."""
    lines = []
    for name, r in reports.items():
        pairs = _idle_by_host(r.get("gpu_time_split")).get("by_op", [])[:top]
        if pairs:
            lines.append(f"- {name}: " + "; ".join(f"{p['phase']} / {p['op']} {p['ms']:.1f} ms ({p['gaps']} gaps)"
                                                  for p in pairs))
    return lines


def summary(folder: str) -> str:
    """The whole table: reports, idle time by launching op, targets, tests."""
    reports = load_reports(folder)
    parts = rows(reports)
    if idle := idle_ops(reports):
        parts += ["", "Longest GPU idle of the profiled step, by the host op whose launch ended it:"] + idle
    parts += ["", "Targets (free-running, compiled):"] + targets(reports, folder)
    parts += ["", "Tests:"] + (tests(folder) or ["- none run"])
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/gpu_summary.py OUTPUT_FOLDER")
    print(summary(sys.argv[1]), end="")
