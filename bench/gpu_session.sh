#!/usr/bin/env bash
# Every GPU check of the memory runtime in one call, for a lent GPU machine (see the workplace's device
# README): the CUDA tests, the resident-speed comparison, the budget sweep, and the two-GPU splits when
# two GPUs are there. Logs and result files go to $1 (default bench/results).
#
#   bash bench/gpu_session.sh "$OUT"
#
# Needs torch with CUDA; diffusers for the comparison rows (carry it as wheels in .whl/ where it is missing:
# this script installs them into /tmp/site first).
set -u
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/memory --ignore=tests/engine/memory/test_autofit_plan.py 2>&1 | tail -3
timeout 100 python3 bench/unet_resident.py > "$out/unet_resident.log" 2>&1
grep -E "^\|" "$out/unet_resident.log" | tail -8
if [ "$gpus" -ge 2 ]; then
    timeout 120 python3 bench/multi_gpu.py > "$out/multi_gpu.log" 2>&1
    tail -6 "$out/multi_gpu.log"
fi
timeout 270 python3 bench/memory.py --out "$out" > "$out/memory.log" 2>&1
grep -E "^SD|^wrote|infeasible|capture failed" "$out/memory.log"
