#!/usr/bin/env bash
# Run the whole test suite (multi-process tests included) on CPU; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
source tools/ensure_venv.sh
exec python -m pytest "$@"
