#!/usr/bin/env bash
# GPU check, for a fresh single-GPU CUDA machine. Not part of `make test`.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # steps 1-5 finish within 15 minutes
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
# 6. vLLM-Omni's Qwen3-TTS on Model Runner V2: `vllm-omni serve MODEL --omni`
#    with vLLM-Omni's shipped deploy (vllm_omni/deploy/qwen3_tts.yaml, whose
#    `model_runner: v2` is the runner on CUDA) and kv-budget under
#    --model-local-kv-policy cap. Both stages must log vLLM-Omni's "Using MR
#    v2" runner line, kv-budget must log that it planned on the V2 runner's
#    model in stage 1 (code2wav) and write plan.stage1-replica0.json with
#    that stage's decoder declarations; one /v1/audio/speech request is sent
#    and its outcome printed. vLLM-Omni 0.30.0 needs vLLM 0.30, so it gets a
#    venv of its own (.venv-gpu-omni, `.[omni]`); the checkpoint is
#    $QWEN3_TTS_MODEL, else the small random Qwen3-TTS checkpoint of
#    tests/omni_cpu (kv_budget_omni_cpu.qwen3_tts_checkpoint). SKIPPED where
#    vLLM-Omni cannot be installed. Adds up to 10 minutes to steps 1-5.
# 7. vLLM's Ray executor and pipeline parallel (benchmarks/gpu_ray_check.py):
#    the demo through vllm.LLM with --distributed-executor-backend ray
#    (tensor parallel 2 where two GPUs are visible, else 1), each Ray
#    worker's budget sampled by NVML inside it, the cap their minimum, 256
#    requests; with two GPUs also pipeline parallel 2 (the one constraint is
#    the last rank's). vLLM's CPU build has no Ray executor, so this runs only
#    here. Installs `ray` into .venv-gpu; SKIPPED where it cannot. Adds up to
#    10 minutes.
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
    $PY -c "from vllm_patches.compat import check_vllm; print('[gpu-check]', check_vllm())" 2>&1 \
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

step6=SKIPPED
OMNI_PY=.venv-gpu-omni/bin/python
[ -x "$OMNI_PY" ] || python3 -m venv --system-site-packages .venv-gpu-omni
if ! $OMNI_PY -c "import vllm_omni, kv_budget" 2>/dev/null; then
    timeout 420 $OMNI_PY -m pip install -q -e '.[omni]' >"$OUT_DIR/pip-omni.log" 2>&1 \
        || echo "[gpu-check] pip could not install vLLM-Omni 0.30.0 (.[omni], offline?): see $OUT_DIR/pip-omni.log"
fi
if $OMNI_PY -c "import vllm_omni, kv_budget" 2>/dev/null; then
    echo "[gpu-check] step 6: vLLM-Omni Qwen3-TTS on Model Runner V2, policy cap"
    tts="$OUT_DIR/qwen3-tts"
    mkdir -p "$tts"
    model=${QWEN3_TTS_MODEL:-}
    if [ -z "$model" ]; then
        model="$tts/checkpoint"
        PYTHONPATH="$PWD/tests/omni_cpu${PYTHONPATH:+:$PYTHONPATH}" timeout 180 \
            $OMNI_PY -m kv_budget_omni_cpu.qwen3_tts_checkpoint "$model" >"$tts/checkpoint.log" 2>&1 || model=""
    fi
    # The deploy vLLM-Omni ships, as shipped (found without importing vllm_omni, which patches vLLM).
    deploy=$($OMNI_PY -c "import importlib.util as u; print(u.find_spec('vllm_omni').submodule_search_locations[0])")
    deploy="$deploy/deploy/qwen3_tts.yaml"
    port=$($OMNI_PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    if [ -z "$model" ]; then
        step6=FAIL
        echo "[gpu-check] step 6: no checkpoint (set QWEN3_TTS_MODEL); see $tts/checkpoint.log"
        tail -20 "$tts/checkpoint.log"
    else
        grep -n "model_runner" "$deploy" | head -3
        # Its own session, so stopping it stops the stage processes it spawned.
        setsid .venv-gpu-omni/bin/vllm-omni serve "$model" --omni --deploy-config "$deploy" \
            --host 127.0.0.1 --port "$port" --stage-init-timeout 420 \
            --model-local-kv-policy cap --model-local-kv-report "$tts/plan.json" >"$tts/server.log" 2>&1 &
        server=$!
        PORT=$port MODEL=$model timeout 480 $OMNI_PY - >"$tts/request.log" 2>&1 <<'PYEOF'
import json, os, time, urllib.request
url = f"http://127.0.0.1:{os.environ['PORT']}"
for _ in range(450):  # the stages start one after the other: CUDA graphs, the decoder's graphs
    try:
        urllib.request.urlopen(f"{url}/health", timeout=5).read()
        break
    except OSError:
        time.sleep(1)
else:
    raise SystemExit("the server did not become healthy")
print("healthy")
body = json.dumps({"model": os.environ["MODEL"], "input": "Admission control for model-local caches.",
                   "response_format": "wav"}).encode()
request = urllib.request.Request(f"{url}/v1/audio/speech", body, {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as response:
        audio = response.read()
    print("speech:", response.status, len(audio), "bytes", "RIFF" if audio[:4] == b"RIFF" else "not a WAV")
except Exception as exc:  # printed, not failed on: random weights may end the speech at once
    print("speech request failed:", type(exc).__name__, exc)
PYEOF
        healthy=$?
        kill -TERM -- "-$server" 2>/dev/null
        ( sleep 30; kill -KILL -- "-$server" 2>/dev/null ) &
        killer=$!
        wait "$server" 2>/dev/null
        kill "$killer" 2>/dev/null
        kill -KILL -- "-$server" 2>/dev/null  # a stage process left behind
        cat "$tts/request.log"
        grep -o "Using MR v2 Omni[A-Za-z]*ModelRunner[^.]*" "$tts/server.log" | sort -u
        grep -o "kv-budget: rank [0-9]* runs vLLM's Model Runner V2 ([A-Za-z]*)[^)]*)" "$tts/server.log" | sort -u
        # Stage 1 planned on Model Runner V2: the runner lines, kv-budget's own line for the
        # code2wav runner, and its report with the stage's declarations.
        if [ "$healthy" = 0 ] \
            && grep -q "Using MR v2 OmniARModelRunner" "$tts/server.log" \
            && grep -q "Using MR v2 OmniGenerationModelRunner" "$tts/server.log" \
            && grep -q "kv-budget: rank 0 runs vLLM's Model Runner V2 (OmniGenerationModelRunner)" "$tts/server.log" \
            && $OMNI_PY - "$tts/plan.stage1-replica0.json" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
declared = sorted({f"{d['owner']}/{d['name']}" for w in report["workers"] for d in w["declarations"]})
print(f"[gpu-check] stage {report['stage']['stage_id']}: policy {report['policy']}, decision {report['decision']}, "
      f"max_num_seqs {report['configured_max_num_seqs']} -> {report['effective_max_num_seqs']}, "
      f"per sequence {report['per_seq_bytes']:,} B, headroom {report['headroom_bytes']:,} B; declared: {declared}")
sys.exit(0 if report["stage"]["stage_id"] == 1 and report["policy"] == "cap" and declared
         and report["decision"] in ("ok", "capped") else 1)
PYEOF
        then
            step6=PASS
        else
            step6=FAIL
            grep -n "kv-budget\|Error\|error" "$tts/server.log" | tail -40
        fi
    fi
else
    echo "[gpu-check] step 6 SKIPPED: vLLM-Omni 0.30.0 is not installed and could not be installed here"
fi

step7=SKIPPED
if [ "$step2" != SKIPPED ]; then
    $PY -c "import ray" 2>/dev/null || timeout 300 $PY -m pip install -q ray >>"$OUT_DIR/pip.log" 2>&1 \
        || echo "[gpu-check] pip could not install ray: see $OUT_DIR/pip.log"
    if $PY -c "import ray" 2>/dev/null; then
        echo "[gpu-check] step 7: the Ray executor and pipeline parallel"
        if timeout 900 $PY benchmarks/gpu_ray_check.py "$OUT_DIR/ray" 2>&1 | tee "$OUT_DIR/step7.log"; then
            step7=PASS
        else
            step7=FAIL
        fi
    fi
fi

echo "[gpu-check] step 1 (NVML/CUDA): $([ "$step1" = 0 ] && echo PASS || echo FAIL); step 2 (demo): $step2;" \
    "step 3 (reserve): $step3; step 4 (live): $step4; step 5 (deployment split): $step5;" \
    "step 6 (Qwen3-TTS on Model Runner V2): $step6; step 7 (Ray, pipeline parallel): $step7;" \
    "$(( $(date +%s) - start )) s"
[ "$step1" = 0 ] && [ "$step2" != FAIL ] && [ "$step3" != FAIL ] && [ "$step4" != FAIL ] && [ "$step5" = PASS ] \
    && [ "$step6" != FAIL ] && [ "$step7" != FAIL ]
