#!/usr/bin/env bash
# One prepared GPU check for issue 7 (Triton tree attention, SpecInfer Section 4.2): see
# scripts/gpu_notes.md for what it measures and where to record each run.
#
#   scripts/gpu_check.sh pack [MODELS]       # here, once: pack the reference pair (default
#                                            # ../shared/models) into .gpu_carry/ (git-ignored,
#                                            # ~48 MiB) so it can travel to the GPU machine
#   scripts/gpu_check.sh run OUT.md [MODELS] # on the GPU machine; under 8 minutes
#   scripts/gpu_check.sh tiny OUT.md [MODELS]# CPU: Triton's interpreter at tiny shapes (<30 s)
#
# On the GPU machine (../shared does not travel there, .gpu_carry does):
#   device run, carry [".gpu_carry"], timeout_s 540:
#   set -o pipefail; bash scripts/gpu_check.sh run $OUT/gpu_check.md 2>&1 | tee $OUT/gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
shift || true
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

case "$cmd" in
  pack)
    src=${1:-../shared/models}
    mkdir -p .gpu_carry
    if [ -d .git ] && ! grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null; then
      mkdir -p .git/info && echo '/.gpu_carry/' >> .git/info/exclude
    fi
    tar -C "$src" -cf - reference-llm reference-ssm | xz -T0 -6 > .gpu_carry/models.tar.xz
    ls -l .gpu_carry/models.tar.xz
    ;;
  run)
    out=${1:?usage: gpu_check.sh run OUT.md [MODELS]}
    models=${2:-}
    if [ -z "$models" ]; then
      if [ -f .gpu_carry/models.tar.xz ]; then
        models=/tmp/gpu_check_models
        mkdir -p "$models"
        tar -C "$models" -xJf .gpu_carry/models.tar.xz
      else
        models=../shared/models
      fi
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
    # 470 s hard stop; the script itself stops starting new work after --budget-s.
    timeout 470 "$PY" scripts/gpu_check.py "$out" --models "$models" --budget-s 400
    ;;
  tiny)
    out=${1:?usage: gpu_check.sh tiny OUT.md [MODELS]}
    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" "$PY" scripts/gpu_check.py "$out" --tiny --models "${2:-../shared/models}"
    ;;
  *)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
