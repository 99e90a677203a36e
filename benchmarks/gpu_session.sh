#!/usr/bin/env bash
# One call on a GPU machine (docs/performance.md, "GPU"): the environment, the throughput benchmark at 16B shapes
# cut to 4 layers (train_configs/h100_bench.toml) in the variants issue 14 asks for, and the CUDA tests.
#
#   bash benchmarks/gpu_session.sh                  # everything; writes to $OUT if set, else outputs/gpu_session
#   PARTS="bench" bash benchmarks/gpu_session.sh    # only some of: tests bench fp8 (default: tests bench)
#   DEADLINE_S=1000 bash benchmarks/gpu_session.sh  # more than the default 540 s in all
#   CONFIG=... BENCH_ARGS="--steps 20" bash ...      # another config, or flags added to every benchmark run
#
# The machine has torch and its friends in its own python3 but no .venv and no package registry: .venv/bin/python
# becomes a two-line wrapper around that python3 and the stamp tools/ensure_venv.sh checks is written, so
# run_train.sh and run_tests.sh run as they are. Each step gets its own time limit, cut to what is left of
# DEADLINE_S, so the script ends in time and a failing or slow step does not stop the others. Results in the
# output folder: machine.txt, one throughput.py JSON report per variant (<name>.json), attention_kernels.json
# (benchmarks/attention_kernels.py at the same shapes), each step's stderr
# (<name>.log), pytest's junit XML, and summary.txt (one line per step: exit code, seconds; 124 = time limit).
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-outputs/gpu_session}"
parts="${PARTS:-tests bench}"
config="${CONFIG:-train_configs/h100_bench.toml}"
read -r -a bench_args <<< "${BENCH_ARGS:-}"
deadline=$((SECONDS + ${DEADLINE_S:-540}))
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"

# (1) .venv as a wrapper around the machine's python3 (a real venv is left alone)
py="$(command -v python3)"
if [ ! -e .venv/pyvenv.cfg ]; then
  rm -rf .venv
  mkdir -p .venv/bin
  printf '#!/bin/sh\nexec %s "$@"\n' "$py" > .venv/bin/python
  # run_train.sh execs torchrun: the launcher of the same python, whatever else is on PATH
  printf '#!/bin/sh\nexec %s -m torch.distributed.run "$@"\n' "$py" > .venv/bin/torchrun
  chmod +x .venv/bin/python .venv/bin/torchrun
  sha256sum pyproject.toml | cut -d' ' -f1 > .venv/.pyproject.sha256
fi
export PATH="$PWD/.venv/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_S CMD...: run CMD (stderr to <out>/NAME.log) for at most LIMIT_S or what is left of the deadline
step() {
  local name="$1" limit="$2" t0=$SECONDS rc=0
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "$name skipped: deadline" | tee -a "$summary" >&2
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit} s): $*" >&2
  timeout "$limit" "$@" 2> "$out/$name.log" || rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary" >&2
}

# bench NAME LIMIT_S [trainer flags]: one throughput.py report of $config (the issue's shapes)
bench() {
  local name="$1" limit="$2"
  shift 2
  step "$name" "$limit" sh -c 'report="$1"; shift; python benchmarks/throughput.py "$@" > "$report"' sh \
    "$out/$name.json" --config "$config" "$@" ${bench_args[@]+"${bench_args[@]}"}
}

# (2) the machine
{
  nvidia-smi || echo "nvidia-smi: not found"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv || true
  python -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda",
    torch.version.cuda, "| cudnn", torch.backends.cudnn.version(), "| device",
    torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  python -c 'import triton; print("triton", triton.__version__)' || true
  python -c 'import pytest; print("pytest", pytest.__version__)' || echo "pytest: not installed"
} 2>&1 | tee "$out/machine.txt"

# (3) throughput: eager batch 2 and 4, compiled, AC full and selective (batch 2); MLA attention on every SDPA kernel
if [[ " $parts " == *" bench "* ]]; then
  bench throughput_b2 90
  bench throughput_b4 90 --training.local_batch_size 4
  step attention_kernels 60 sh -c 'python benchmarks/attention_kernels.py > "$1"' sh "$out/attention_kernels.json"
  bench throughput_b2_compile 240 --compile.enable true
  bench throughput_b2_ac_full 90 --activation_checkpoint.mode full
  bench throughput_b2_ac_selective 90 --activation_checkpoint.mode selective
fi

# (3b) FP8 (docs/fp8.md): the same shapes with each recipe; blockwise leaves out the dense FFN (10944 wide, not a
# multiple of 128) besides wkv_a
if [[ " $parts " == *" fp8 "* ]]; then
  bench throughput_b2_fp8_rowwise 120 --fp8.recipe rowwise
  bench throughput_b2_fp8_blockwise 120 --fp8.recipe blockwise --fp8.exclude_modules attention.wkv_a,feed_forward
fi

# (4) the CUDA tests, then the model's tests and the benchmark's schema on the GPU
if [[ " $parts " == *" tests "* ]]; then
  if python -c 'import pytest' 2>/dev/null; then
    step tests_cuda 180 python -m pytest -q -rs -m cuda tests/ --junitxml="$out/tests_cuda.xml"
    step tests_model 120 python -m pytest -q -rs tests/test_model.py tests/test_throughput.py -k "not scaling" \
      --junitxml="$out/tests_model.xml"
  else
    echo "tests skipped: pytest is not installed in $py" | tee -a "$summary" >&2
  fi
fi
cat "$summary"
