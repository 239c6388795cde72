#!/usr/bin/env bash
# The GPU suite cut to fit one short device lease (about 8 minutes of one call): where the
# GPU's peaks and the simulator's differ (gpu_peak_gaps.py, 30 s); our offload
# plans at the H100 anchors against offloading every block and save_on_cpu (peaks of the
# first and of a second step); offload plans run twice each (offload_release_check.py: the
# same peak on every run); the fp32 frontier of GPT-2-medium against the hand-written peers
# (no torch.compile, no auto-SAC: each costs minutes). The per-op CUDA profiles (`--part
# record`) ran out of GPU memory on 2026-11-26 (timing GPT-2-medium's ops one by one) and
# are left out until that is fixed. Each part runs
# under its own time limit so that every part's files are written. Run on a device machine
# from the repo root with the wheels of gpu_suite.py's WHEELS in .whl/ and OUT set;
# everything lands in $OUT/gpu.tgz (results) and $OUT/gpu.log (the whole output). The first
# run (2026-11-26) ran fp32, offload, bf16 in that order: no time was left for our offload
# plans.
#
# LEASE=clock (the default since 2026-11-29): the fp32 and bf16 frontiers only, each row with
# its host / device split (issue 62); LEASE=memory: the parts above; LEASE=compile (issue
# 64): GPT-2-medium compiled per block, ours against activation_memory_budget at 0.5, fp32
# and bf16, head to head (benchmarks/compile_head_to_head.py; results written per pairing).
#
#   bash benchmarks/gpu_lease.sh   # then: tar xzf gpu.tgz; results into benchmarks/results,
#                                  # <case>.<gpu>.json profiles into profiles/recorded
set -u
R=${OUT:?OUT must name a folder}/results
mkdir -p "$R"
exec > >(tee "$OUT/gpu.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, ortools; print('torch', torch.__version__, torch.cuda.get_device_name())"

part() {  # part NAME OUTER_TIMEOUT_S ARGS...: one part of the suite, killed at its timeout
  local name=$1 limit=$2
  shift 2
  echo "== lease part $name (timeout ${limit} s) at $(date +%T)"
  timeout "$limit" python3 benchmarks/gpu_suite.py --part "$name" --out "$R" \
    --profiles-dir "$R" "$@"
  echo "== lease part $name exit $? at $(date +%T)"
}

if [ "${LEASE:-clock}" = clock ]; then  # issue 62: the frontier's clock, host and device
  part fp32 260 --peers every-layer every-2nd chen-sqrt-n sac-linear --time-limit 200 \
    --solve-time-limit 20
  part bf16 200 --peers every-layer every-2nd chen-sqrt-n sac-linear --time-limit 150 \
    --solve-time-limit 20
elif [ "$LEASE" = compile ]; then  # issue 64: GPT-2-medium compiled per block, fp32 and bf16
  echo "== lease part compile (timeout 560 s) at $(date +%T)"
  timeout 560 python3 benchmarks/compile_head_to_head.py --device cuda --models gpt2-medium \
    --modes blocks --fractions 0.5 --precisions fp32 bf16 --rounds 9 --steps-a-turn 3 \
    --out "$R"
  echo "== lease part compile exit $? at $(date +%T)"
else
  echo "== lease part peak gaps (timeout 90 s) at $(date +%T)"
  timeout 90 python3 benchmarks/gpu_peak_gaps.py --out "$R"
  echo "== lease part peak gaps exit $? at $(date +%T)"
  part offload 180 --time-limit 140 --solve-time-limit 15
  echo "== lease part release check (timeout 150 s) at $(date +%T)"
  timeout 150 python3 benchmarks/offload_release_check.py --out "$R" --solve-time-limit 20
  echo "== lease part release check exit $? at $(date +%T)"
  part fp32 150 --peers every-layer every-2nd chen-sqrt-n sac-linear --time-limit 105 \
    --solve-time-limit 15
fi
tar czf "$OUT/gpu.tgz" -C "$R" . && rm -rf "$R"
ls -la "$OUT"
