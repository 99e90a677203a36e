#!/usr/bin/env bash
# Run the whole test suite (multi-process tests included) on CPU; extra arguments go to pytest.
# Two pytest-xdist workers by default (TEST_WORKERS; 0 runs the tests in this process, as `-n 0` after the
# arguments does): the multi-process tests spend much of their time waiting (launches, signals, timeouts),
# which the other worker overlaps.
set -euo pipefail
cd "$(dirname "$0")"
source tools/ensure_venv.sh
exec python -m pytest -n "${TEST_WORKERS:-2}" --dist worksteal "$@"
