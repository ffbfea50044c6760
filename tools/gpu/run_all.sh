#!/usr/bin/env bash
# Every GPU check in one prepared run (for a lent CUDA machine; CI never runs this).
#
#   python tools/check_wheels.py --build --out .whl     # here: build Opake's wheels to carry
#   bash tools/gpu/run_all.sh                           # there: results land in $OUT
#
# The machine has its own torch/triton/transformers; Opake's pure-Python wheels are installed
# into a private --target folder (no dependencies, no index) so the plugin entry points exist.
# Everything printed goes to $OUT/run.log; each check also writes its own report under $OUT.
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
exec > >(tee "$OUT/run.log") 2>&1
if ls .whl/opake*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/opake-site .whl/opake*.whl \
    && export PYTHONPATH=/tmp/opake-site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "from opake.core import plugins; print(sorted(plugins.kernel_backends()), sorted(plugins.model_families()))"
rc=0
step() {  # step NAME SECONDS command...
  local name=$1 secs=$2; shift 2
  echo; echo "=== $name (limit ${secs}s)"; local t0=$SECONDS
  timeout "$secs" "$@" || { echo "=== $name: FAILED (exit $?)"; rc=1; }
  echo "=== $name: $((SECONDS - t0)) s"
}
step kernels "${KERNELS_S:-250}" python3 tools/gpu/kernels_check.py --budget "${KERNELS_BUDGET:-200}"
step profiling "${PROFILING_S:-170}" python3 tools/gpu/profiling_check.py --budget "${PROFILING_BUDGET:-130}"
step training 90 python3 tools/gpu/training_step_check.py --out "$OUT/training.json"
step clip-kernel 60 python3 tools/gpu/clip_kernel_check.py
step clipping-proof 120 python3 tools/gpu/clipping_proof_check.py --out "$OUT/clipping_proof.json"
step ddp 90 python3 tools/gpu/ddp_check.py --out "$OUT/ddp.json"
# FSDP2 level 2 (sharded_clipped_grad) on nccl: needs 2 GPUs, else reports "skipped" and passes
step fsdp-sharded 90 python3 tools/gpu/fsdp_sharded_check.py --out "$OUT/fsdp_sharded.json"
step bk-loss-only 150 python3 tools/bench/bk_loss_only.py --device cuda --hidden 1024 --layers 4 \
  --vocab 128256 --batch 8 --seq 1024 --steps 3 --warmup 1 \
  --methods nonprivate nonprivate-lossonly bk-logits bk-lossonly --json "$OUT/bk_loss_only.json"
step checkpoint-memory 120 python3 tools/bench/checkpoint_memory.py --device cuda --offload --json "$OUT/ckpt_cuda.json"
step compile 200 python3 tools/bench/compile_step.py --device cuda --steps 5 --warmup 2 \
  --methods nonprivate nonprivate-compiled opake-bk opake-compiled opake-bk-compiled \
  --json "$OUT/compile.json"
# the real model's DP step (SmolLM2-135M's architecture, random weights: no download) vs non-private
step smollm2-step 240 python3 tools/bench/dpsgd_step.py --device cuda --model smollm2-shape \
  --batch 16 --seq 256 --modes full lora --methods nonprivate opake-user --rounds 2 --steps 5 \
  --warmup 2 --threads 4 --json "$OUT/smollm2_step.json"
step gpu-tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="--import-mode=importlib" \
  packages/opake-core/tests packages/opake-patches/tests packages/opake-kernels/tests packages/opake-profiling/tests
exit $rc
