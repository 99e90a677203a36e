# Sourced by run_train.sh and run_tests.sh: create or refresh the local .venv, then use it.
# The dev extra pins torch==2.13.0 (a CPU build on the dev machines; a looser pin would pull a multi-GB CUDA build).
# Re-installs only when pyproject.toml changed since the last install.
VENV_DIR="${VENV_DIR:-.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV_DIR/.pyproject.sha256"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x "$VENV_DIR/bin/python" ]; then
  echo "creating $VENV_DIR ..." >&2
  "$PYTHON" -m venv "$VENV_DIR"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing the project into $VENV_DIR (pip install -e .[dev]) ..." >&2
  "$VENV_DIR/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV_DIR/bin/python" -m pip install --quiet -e ".[dev]" >&2
  echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV_DIR/bin:$PATH"
# Hugging Face's offline switch is not set here: the trainer sets it itself unless the config has
# dataset.allow_download = true (trainer/data/sources.py), and tests/conftest.py sets it for the tests.
export TIKTOKEN_CACHE_DIR="${TIKTOKEN_CACHE_DIR-}"
