# Sourced by run_train.sh and run_tests.sh: create or refresh the local .venv, then use it.
# The dev extra pins torch==2.13.0 (a CPU build on the dev machines; a looser pin would pull a multi-GB CUDA build).
# TORCH_VERSION=2.11.0 makes and uses .venv-torch2.11.0 instead: the test extra with that torch release, to test
# the oldest torch the trainer supports (docs/torch_versions.md). No CPU build of 2.11 is in the registry, so that
# is the CUDA build and its CUDA libraries from PyPI (about 5.3 GB), which import and run on a CPU-only machine.
# Re-installs only when pyproject.toml (or TORCH_VERSION) changed since the last install.
if [ -n "${TORCH_VERSION:-}" ]; then
  VENV_DIR="${VENV_DIR:-.venv-torch$TORCH_VERSION}"
  requirements=(-e ".[test]" "torch==$TORCH_VERSION")
else
  VENV_DIR="${VENV_DIR:-.venv}"
  requirements=(-e ".[dev]")
fi
PYTHON="${PYTHON:-python3}"
stamp="$VENV_DIR/.pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)${TORCH_VERSION:+ torch==$TORCH_VERSION}"
if [ ! -x "$VENV_DIR/bin/python" ]; then
  echo "creating $VENV_DIR ..." >&2
  "$PYTHON" -m venv "$VENV_DIR"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing the project into $VENV_DIR (pip install ${requirements[*]}) ..." >&2
  "$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV_DIR/bin/python" -m pip install --quiet "${requirements[@]}" >&2
  echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV_DIR/bin:$PATH"
# Hugging Face's offline switch is not set here: the trainer sets it itself unless the config has
# dataset.allow_download = true (trainer/data/sources.py), and tests/conftest.py sets it for the tests.
export TIKTOKEN_CACHE_DIR="${TIKTOKEN_CACHE_DIR-}"
