#!/usr/bin/env bash
# Set up everything in ./.venv on a machine that has only Python 3.10+: torch, the package
# and its dev extras. Idempotent: re-running after a change to pyproject.toml reinstalls.
#
#   TORCH_SPEC       torch requirement to install first (default: torch==2.13.0)
#   TORCH_INDEX_URL  pip index for torch, e.g. the CUDA or CPU index the PyTorch install
#                    selector gives you; unset = your pip's default index
#   PYTHON           interpreter to build the venv with (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
stamp="$VENV/.installed-$( (cat pyproject.toml; echo "$TORCH_SPEC") | sha256sum | cut -c1-16)"

if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing $TORCH_SPEC"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" install --quiet "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
  else
    "${pip[@]}" install --quiet "$TORCH_SPEC"
  fi
fi
echo "bootstrap: installing checkpoint-planner[dev]"
"${pip[@]}" install --quiet -e ".[dev]"
rm -f "$VENV"/.installed-*
touch "$stamp"
"$VENV/bin/python" -c "import torch, ortools, planner; print('bootstrap: ready, torch', torch.__version__)"
