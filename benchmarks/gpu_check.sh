#!/usr/bin/env bash
# GPU check, for a fresh single-GPU CUDA machine. Not part of `make test`.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # finishes within 15 minutes
#
# 1. NVML and CUDA without vLLM (benchmarks/gpu_nvml_check.py): the real
#    NVML sampler, by index and by UUID, a real StaticCache on the GPU
#    whose declared, audited and allocated bytes must agree, and a declarer
#    asked from the collector's thread on the caller's CUDA device.
# 2. The demo with NVML-measured headroom: a real vLLM api_server with the
#    plugin under --model-local-kv-policy cap, 256 concurrent requests; it
#    prints the plan, the measured peak model-local bytes and whether any
#    request failed. The talker is made large (32768 positions, 128 MiB per
#    sequence) so the cap bites against a measured H100/H200-sized headroom.
# 3. cap vs reserve (benchmarks/bench_reserve.py, one round): policy reserve
#    on a pool vLLM sized on the GPU.
# 4. live sampling's cost (benchmarks/bench_live.py, one round): 256 running
#    requests whose talker rows are built each step on the GPU; sampling with
#    the sampled steps watched inside (in-step peaks of CUDA caches), sampling
#    between steps only, and no sampling; and the cost of one watched step.
# 5. stages sharing a device (benchmarks/gpu_deploy_check.py): two stage
#    processes start one after the other on device 0, each holding its
#    share of real CUDA memory; their deployment split (NVML capacity and
#    free memory) must equal `kv-budget plan --deploy`'s, and the model-local
#    KV each then allocates at its split must fit. Needs no vLLM.
#
# Installs what it needs into .venv-gpu (PyTorch from the machine where one
# is installed, plus kv-budget with the `cuda` extra). Where the package
# index cannot be reached and vLLM is not installed, step 2 is reported as
# SKIPPED and step 1 still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || { echo "no NVIDIA GPU"; exit 1; }

PY=python3
if ! $PY -c "import vllm" 2>/dev/null; then
    $PY -m venv --system-site-packages .venv-gpu && PY=.venv-gpu/bin/python
    if timeout 300 $PY -m pip install -q -e '.[cuda,test]' -e ./demo >"$OUT_DIR/pip.log" 2>&1; then
        echo "[gpu-check] installed kv-budget[cuda] into .venv-gpu"
    else
        echo "[gpu-check] pip could not install vllm (offline?): see $OUT_DIR/pip.log; installing kv-budget alone"
        $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT_DIR/pip.log" 2>&1 \
            || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
# The demo is a distribution of its own (demo/): its vLLM plugin registers
# the demo architecture, so it must be installed, not only importable.
$PY -c "import kv_budget_demo" 2>/dev/null \
    || $PY -m pip install -q --no-deps --no-build-isolation -e . -e ./demo >>"$OUT_DIR/pip.log" 2>&1 \
    || echo "[gpu-check] could not install the demo (demo/): see $OUT_DIR/pip.log"
$PY -c "import torch, transformers, pydantic, pynvml, psutil; print('[gpu-check] torch', torch.__version__, 'transformers', transformers.__version__)"

echo "[gpu-check] step 1: NVML and CUDA caches"
$PY benchmarks/gpu_nvml_check.py "$OUT_DIR" 2>&1 | tee "$OUT_DIR/step1.log"
step1=${PIPESTATUS[0]}

step2=SKIPPED
if $PY -c "import vllm" 2>/dev/null; then
    # Which vLLM (distribution, version) and how kv-budget checked it: on a
    # CUDA machine `.[cuda]` takes the newest supported vLLM, which is the
    # one no CPU run covers (0.33: checked against source only).
    $PY -c "from kv_budget.vllm.compat import check_vllm; print('[gpu-check]', check_vllm())" 2>&1 \
        | grep '^\[gpu-check\]\|Error' | tee "$OUT_DIR/vllm-version.log"
    echo "[gpu-check] step 2: demo with NVML-measured headroom"
    if timeout 420 $PY -m kv_budget_demo --out "$OUT_DIR/demo" --talker-positions 32768 2>&1 | tee "$OUT_DIR/step2.log"; then
        step2=PASS
    else
        step2=FAIL
        tail -40 "$OUT_DIR/demo/server.log" 2>/dev/null
    fi
else
    echo "[gpu-check] step 2 SKIPPED: vLLM is not installed and could not be installed here"
fi

step3=SKIPPED
if [ "$step2" != SKIPPED ]; then
    # Policy reserve where the pool is sized from a real GPU profile: cap and
    # reserve at the same 1 GiB KV budget (--kv-cache-memory-bytes), one round.
    echo "[gpu-check] step 3: cap vs reserve at the same KV budget"
    if timeout 300 $PY benchmarks/bench_reserve.py --rounds 1 --work "$OUT_DIR/reserve" \
            --json "$OUT_DIR/reserve.json" 2>&1 | tee "$OUT_DIR/step3.log"; then
        step3=PASS
    else
        step3=FAIL
        tail -40 "$OUT_DIR/reserve/reserve/server.log" 2>/dev/null
    fi
fi

step4=SKIPPED
if [ "$step2" != SKIPPED ]; then
    echo "[gpu-check] step 4: live sampling on and off at 256 running sequences"
    if timeout 420 $PY benchmarks/bench_live.py --rounds 1 --work "$OUT_DIR/live" \
            --json "$OUT_DIR/live.json" 2>&1 | tee "$OUT_DIR/step4.log"; then
        step4=PASS
    else
        step4=FAIL
        tail -40 "$OUT_DIR/live/on/server.log" 2>/dev/null
    fi
fi

echo "[gpu-check] step 5: two stages on device 0 split it"
if timeout 300 $PY benchmarks/gpu_deploy_check.py "$OUT_DIR" 2>&1 | tee "$OUT_DIR/step5.log"; then
    step5=PASS
else
    step5=FAIL
fi

echo "[gpu-check] step 1 (NVML/CUDA): $([ "$step1" = 0 ] && echo PASS || echo FAIL); step 2 (demo): $step2;" \
    "step 3 (reserve): $step3; step 4 (live): $step4; step 5 (deployment split): $step5;" \
    "$(( $(date +%s) - start )) s"
[ "$step1" = 0 ] && [ "$step2" != FAIL ] && [ "$step3" != FAIL ] && [ "$step4" != FAIL ] && [ "$step5" = PASS ]
