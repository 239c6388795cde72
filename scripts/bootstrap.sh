#!/usr/bin/env bash
# Set up everything in ./.venv on a machine that has only Python 3.10+: torch and torchvision,
# the package and its dev extras. Idempotent: re-running after a change to pyproject.toml or
# TORCH_SPEC reinstalls what changed.
#
#   TORCH_SPEC       torch (and torchvision) requirements to install first
#                    (default: "torch==2.14.1 torchvision==0.29.1", a matching pair)
#   TORCH_INDEX_URL  pip index for them, e.g. the CUDA or CPU index the PyTorch install
#                    selector gives you; unset = your pip's default index
#   PYTHON           interpreter to build the venv with (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}
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
# torchvision's compiled ops must match torch exactly, so both come from one pip call
read -r -a torch_reqs <<< "$TORCH_SPEC"
echo "bootstrap: installing ${torch_reqs[*]}"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  "${pip[@]}" install --quiet "${torch_reqs[@]}" --index-url "$TORCH_INDEX_URL"
else
  "${pip[@]}" install --quiet "${torch_reqs[@]}"
fi
echo "bootstrap: installing checkpoint-planner[dev]"
"${pip[@]}" install --quiet -e ".[dev]"
rm -f "$VENV"/.installed-*
touch "$stamp"
"$VENV/bin/python" -c "import torch, torchvision, ortools, planner; print('bootstrap: ready, torch', torch.__version__, 'torchvision', torchvision.__version__)"
