#!/usr/bin/env bash
# Every GPU check in one prepared run (for a lent CUDA machine; CI never runs this).
#
#   python tools/check_wheels.py --build --out .whl     # here: build Opake's wheels to carry
#   bash tools/gpu/run_all.sh                           # there: results land in $OUT
#
# The machine has its own torch/triton/transformers; Opake's pure-Python wheels are installed
# into a private --target folder (no dependencies, no index) so the plugin entry points exist.
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
if ls .whl/opake*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/opake-site .whl/opake*.whl \
    && export PYTHONPATH=/tmp/opake-site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  python3 -c "from opake.core import plugins; print(sorted(plugins.kernel_backends()), sorted(plugins.model_families()))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
rc=0
timeout "${KERNELS_S:-270}" python3 tools/gpu/kernels_check.py --budget "${KERNELS_BUDGET:-210}" > "$OUT/kernels.log" 2>&1 || rc=1
tail -25 "$OUT/kernels.log"
timeout "${PROFILING_S:-200}" python3 tools/gpu/profiling_check.py --budget "${PROFILING_BUDGET:-150}" > "$OUT/profiling.log" 2>&1 || rc=1
tail -15 "$OUT/profiling.log"
timeout "${TRAINING_S:-90}" python3 tools/gpu/training_step_check.py --out "$OUT/training.json" > "$OUT/training.log" 2>&1 || rc=1
tail -8 "$OUT/training.log"
timeout "${DDP_S:-90}" python3 tools/gpu/ddp_check.py --out "$OUT/ddp.json" > "$OUT/ddp.log" 2>&1 || rc=1
tail -8 "$OUT/ddp.log"
exit $rc
