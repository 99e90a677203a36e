#!/usr/bin/env bash
# Train: NGPU processes on this node via torchrun, config from CONFIG_FILE (unset: the trainer's default,
# DEFAULT_CONFIG_FILE in trainer/job_config.py, train_configs/debug_model.toml), every extra argument is a config
# override (--section.key value). Multi-node: set NNODES, NODE_RANK and RDZV_ENDPOINT (host:port) on every node,
# or pass any torchrun flags in TORCHRUN_ARGS. MAX_RESTARTS enables torchrun's elastic restarts.
set -euo pipefail
cd "$(dirname "$0")"
source tools/ensure_venv.sh

NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
config=()  # without CONFIG_FILE, preflight and the trainer read their default config (one place: job_config.py)
if [ -n "${CONFIG_FILE:-}" ]; then config=(--job.config_file "$CONFIG_FILE"); fi
MAX_RESTARTS="${MAX_RESTARTS:-0}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
  # CPU ranks stand in for GPUs: share the cores between the NGPU processes instead of oversubscribing them.
  cores="$(nproc)"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / NGPU > 0 ? cores / NGPU : 1 ))}"
fi

# Bad config or input fails here, before any process group: one line, exit code 2, nothing written.
# With --job.print_config true it prints the merged config, with --parallelism.dry_run true the per-rank plan for
# NGPU * NNODES ranks; both exit 10: stop there.
rc=0
# preflight loads torch and reads the model, tokenizer and data: 10-25 s on a busy machine, said first
echo "preflight: checking the config, model, tokenizer, data and checkpoints (world size $(( NGPU * NNODES ))) ..." >&2
python -m trainer.preflight --world-size "$(( NGPU * NNODES ))" "${config[@]}" "$@" || rc=$?
if [ "$rc" -eq 10 ]; then exit 0; elif [ "$rc" -ne 0 ]; then exit "$rc"; fi

if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" --rdzv_backend=c10d
        --rdzv_endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port}" --rdzv_id="${RDZV_ID:-dsv3}")
else
  rdzv=(--standalone)
fi
# torchrun through trainer.launch: a failed run ends with one line naming the rank and its error, and the rank's
# exit code (docs/errors.md), instead of torchrun's failure report. TORCHRUN_ARGS take torchrun's options.
# shellcheck disable=SC2086
exec python -m trainer.launch --nproc_per_node="$NGPU" "${rdzv[@]}" --max-restarts="$MAX_RESTARTS" ${TORCHRUN_ARGS:-} \
  -m trainer.train "${config[@]}" "$@"
