#!/usr/bin/env bash
# The prepared GPU check (Triton tree attention, SpecInfer Section 4.2): see scripts/gpu_notes.md
# for what it measures and where to record each run.
#
#   scripts/gpu_check.sh run OUT.md [MODELS]  # one GPU; under 8 minutes (470 s at most)
#   scripts/gpu_check.sh tiny OUT.md [MODELS] # CPU: Triton's interpreter at tiny shapes (<30 s)
#   scripts/gpu_check.sh tp OUT.md [MODELS]   # only the tensor-parallel step (all GPUs; skipped with one)
#
# `run` and `tiny` end with the tensor-parallel step (scripts/gpu_check_tp.py): the LLM sharded
# over every GPU of the machine against one GPU (tiny: two CPU ranks with gloo).
#
# MODELS holds the reference pair (reference-llm/ and reference-ssm/), as a folder or as a
# .tar.xz archive of those two folders; without it only random-weight models run.
# PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
shift || true
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

models=()
use_models() {  # sets models=(--models DIR) for a folder, or for an archive unpacked into a temporary folder
  local src=${1:-}
  if [ -z "$src" ]; then
    return
  fi
  if [ -f "$src" ]; then
    local dir
    dir=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_models.XXXXXX")
    tar -C "$dir" -xJf "$src"
    src=$dir
  fi
  models=(--models "$src")
}

case "$cmd" in
  run)
    out=${1:?usage: gpu_check.sh run OUT.md [MODELS]}
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
    # Under 8 minutes in all: the check stops starting new work after --budget-s and is killed at
    # 400 s; the tensor-parallel step gets what is left of 460 s (it skips at once with one GPU).
    use_models "${2:-}"
    status=0
    started=$SECONDS
    timeout 400 "$PY" scripts/gpu_check.py "$out" ${models[@]+"${models[@]}"} --budget-s 340 || status=$?
    left=$((460 - (SECONDS - started)))
    if [ "$left" -gt 10 ]; then
      timeout "$left" "$PY" scripts/gpu_check_tp.py "$out" ${models[@]+"${models[@]}"} || status=$?
    fi
    exit $status
    ;;
  tp)
    out=${1:?usage: gpu_check.sh tp OUT.md [MODELS]}
    use_models "${2:-}"
    timeout 240 "$PY" scripts/gpu_check_tp.py "$out" ${models[@]+"${models[@]}"}
    ;;
  tiny)
    out=${1:?usage: gpu_check.sh tiny OUT.md [MODELS]}
    use_models "${2:-}"
    status=0
    CUDA_VISIBLE_DEVICES="" "$PY" scripts/gpu_check.py "$out" --tiny ${models[@]+"${models[@]}"} || status=$?
    CUDA_VISIBLE_DEVICES="" timeout 120 "$PY" scripts/gpu_check_tp.py "$out" --tiny || status=$?
    exit $status
    ;;
  *)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
