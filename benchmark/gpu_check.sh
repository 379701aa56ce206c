#!/usr/bin/env bash
# The GPU check of srt: one command on a bare machine with one CUDA GPU (docs/gpu.md).
#
#   benchmark/gpu_check.sh        # or: make gpu-check
#
# Steps, each time-boxed, each reported PASS or FAIL (a failed step does not stop the next):
#   1  install the carried wheels (.whl/, if any), print versions and the GPU; build the tiny
#      test checkpoints; start writing the 4-layer Qwen3-30B-A3B-shaped checkpoint and then its
#      block-FP8 copy (background)
#   2  the GPU tests (pytest -m gpu) and the Triton kernel tests, compiled for the GPU
#   3  fp32 parity with HF transformers: eager, CUDA graphs, TBO forced, SBO (gpu_parity.py)
#   4  bf16 greedy tokens: CUDA graphs == eager
#   5  decode forwards under forbid_host_sync
#   6  decode step figures of the 30B-shaped checkpoint (gpu_report.py)
#   7  fp8: a) the fp8 Triton kernel tests, and the tiny fp8 checkpoints' logprobs against
#      their dequantized copies, weight-only and W8A8 (gpu_parity.py --check fp8); b) decode
#      step figures of the 30B-shaped fp8 copy, batch sizes as step 6, beside step 6's
#   8  served output tok/s at concurrency 32 (launch_server + bench_serving.py)
# Exit status 1 if any step failed. The whole run fits GPU_CHECK_SECONDS (default 470): a step
# gets its own budget or what is left, whichever is less.
#
# Environment: PYTHON (python3), GPU_CHECK_SECONDS, GPU_CHECK_DIR (/tmp/srt-gpu-check: the
# generated checkpoint, server log), GPU_CHECK_LOG (GPU_CHECK_DIR/gpu_check.log: this output),
# SITE (/tmp/site: where the wheels are installed). For a dry run of the plumbing without a
# GPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_PRESET=small GPU_CHECK_REPORT_ARGS="--batch-size 1 4
# --input-len 32 --output-len 4 --tbo-batch-size 4 --copy-mib 64" (step 1 fails there: no GPU).
set -uo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.." || exit 1
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_SECONDS:-470}
WORK=${GPU_CHECK_DIR:-/tmp/srt-gpu-check}
SITE=${SITE:-/tmp/site}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRESET=${GPU_CHECK_PRESET:-qwen3-30b-a3b-4l}
BIG=$WORK/$PRESET
FP8=$WORK/$PRESET-fp8
FIGURES=$WORK/decode_figures.json # step 6's, shown beside step 7b's
DEFAULT_REPORT_ARGS="--batch-size 1 64 --input-len 512 --output-len 16 --tbo-batch-size 64"
REPORT_ARGS=${GPU_CHECK_REPORT_ARGS:-$DEFAULT_REPORT_ARGS}
DTYPE=bfloat16
GRAPH_FLAGS=(--cuda-graph-max-bs 32)
if [ "$DEVICE" = cpu ]; then # no bf16 kernels on most CPUs, no graphs
    DTYPE=float32
    GRAPH_FLAGS=()
fi
LOG=${GPU_CHECK_LOG:-$WORK/gpu_check.log}
SETSID=$(command -v setsid || true)
export PYTHONPATH="$SITE:$PWD:$PWD/launch:$PWD/test${PYTHONPATH:+:$PYTHONPATH}"
# No network there; quiet progress bars; Triton compiles for the GPU, never interprets.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
unset TRITON_INTERPRET

# ---------------------------------------------------------------------------- the steps
step_setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl ||
            return 1
    else
        echo "no .whl/ folder: using the packages installed here"
    fi
    "$PY" - <<'EOF' || return 1
import importlib.util, sys
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
missing = [m for m in ("zmq", "orjson", "fastapi", "uvicorn", "httptools", "pydantic")
           if importlib.util.find_spec(m) is None]
if missing:
    print("missing (carry their wheels in .whl/):", " ".join(missing))
if not torch.cuda.is_available():
    sys.exit("no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"GPU {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
      f"{p.multi_processor_count} SMs")
sys.exit(1 if missing else 0)
EOF
    "$PY" -c "from make_tiny_models import ensure_tiny_models as e; print(*e().values())"
}

step_gpu_tests() {
    # The files holding gpu-marked tests, not the whole tree: collecting every test module
    # imports client libraries (openai) that the GPU machine may lack.
    local files
    files=$(grep -rlE "pytest\.mark\.gpu" test --include="test_*.py" | sort)
    [ -n "$files" ] || { echo "no gpu-marked tests"; return 0; }
    # shellcheck disable=SC2086
    "$PY" -m pytest -q --tb=short -p no:cacheprovider -m gpu $files
}

step_triton_tests() {
    "$PY" -m pytest -q --tb=short -p no:cacheprovider \
        test/layers/test_triton_backend.py test/layers/moe/test_fused_moe_triton.py
}

step_parity() { "$PY" benchmark/gpu/gpu_parity.py --device "$DEVICE" --check parity; }
step_graphs() { "$PY" benchmark/gpu/gpu_parity.py --device "$DEVICE" --check graphs; }
step_nosync() { "$PY" benchmark/gpu/gpu_parity.py --device "$DEVICE" --check nosync; }

step_report() {
    wait_for_model "$BIG" || return 1
    # shellcheck disable=SC2086
    "$PY" benchmark/gpu/gpu_report.py --model-path "$BIG" --device "$DEVICE" --dtype "$DTYPE" \
        $REPORT_ARGS --figures-json "$FIGURES"
}

step_fp8_parity() {
    local rc=0
    "$PY" -m pytest -q --tb=short -p no:cacheprovider test/layers/quantization/test_fp8_triton.py ||
        rc=1
    "$PY" benchmark/gpu/gpu_parity.py --device "$DEVICE" --check fp8 || rc=1
    return $rc
}

step_fp8_report() { # the decode table alone, beside step 6's (none if step 6 failed)
    wait_for_model "$FP8" || return 1
    # shellcheck disable=SC2086
    "$PY" benchmark/gpu/gpu_report.py --model-path "$FP8" --device "$DEVICE" --dtype "$DTYPE" \
        $REPORT_ARGS --skip profile tbo hf --baseline "$FIGURES"
}

step_serve() {
    wait_for_model "$BIG" || return 1
    local port
    port=$("$PY" -c "import socket; s = socket.create_server(('', 0)); print(s.getsockname()[1])")
    # Its own session, so that the whole server tree goes down with one kill of its group.
    ${SETSID:+"$SETSID"} "$PY" -m launch_server --model-path "$BIG" --device "$DEVICE" \
        --dtype "$DTYPE" --port "$port" --max-total-tokens 32768 \
        ${GRAPH_FLAGS[@]+"${GRAPH_FLAGS[@]}"} >"$WORK/server.log" 2>&1 &
    SERVER=$! # global: the EXIT trap reads it after this function has returned
    trap stop_server EXIT
    trap 'exit 143' TERM INT
    # (a start-up shorter than the step's budget, so that a failed one shows its log)
    if ! wait_healthy "$port" "$SERVER" 45; then
        tail -n 40 "$WORK/server.log"
        return 1
    fi
    "$PY" benchmark/serving/bench_serving.py --backend sglang --port "$port" --num-prompts 128 \
        --random-input-len 256 --random-output-len 64 --random-range-ratio 1 \
        --max-concurrency 32 --disable-tqdm
}

# ---------------------------------------------------------------------------- helpers
stop_server() { # the server's process group (its own session), or the server alone
    local target=$SERVER
    [ -n "$SETSID" ] && target=-$SERVER
    kill -TERM -- "$target" 2>/dev/null || return 0
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        alive "$SERVER" || return 0
        sleep 0.5
    done
    kill -KILL -- "$target" 2>/dev/null
}

alive() { # pid: running (not exited, not a zombie waiting for its parent)
    local state
    [ -n "$1" ] || return 1
    state=$(cut -d')' -f2 "/proc/$1/stat" 2>/dev/null | awk '{print $1}')
    [ -n "$state" ] && [ "$state" != Z ]
}

wait_for_model() { # dir: written in the background since the start
    # The writer writes the checkpoint, then its fp8 copy: waiting for both keeps its CPU work
    # off every timed step. config.json is a checkpoint's last file.
    while alive "${WRITER:-}"; do
        sleep 1
    done
    [ -f "$1/config.json" ] && return 0
    echo "writing the checkpoint failed:"
    tail -n 20 "$WORK/make_model.log"
    return 1
}

wait_healthy() { # port pid seconds: the benchmarks' own probes (benchmark/common/)
    "$PY" - "$@" <<'EOF'
import sys, time
from benchmark.common.process import is_running
from benchmark.common.server import http_ok
port, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
start = time.monotonic()
while time.monotonic() - start < limit:
    if not is_running(pid):
        sys.exit("the server exited during start-up")
    if http_ok(f"http://127.0.0.1:{port}/health"):
        sys.exit(print(f"server up in {time.monotonic() - start:.0f} s"))
    time.sleep(0.5)
sys.exit(f"the server was not healthy after {limit:.0f} s")
EOF
}

RESULTS=()
run_step() { # title budget name: runs step_<name> in a child, time-boxed
    local title=$1 limit=$2 name=$3 start=$SECONDS rc verdict=PASS
    local left=$((TOTAL - SECONDS))
    ((limit > left)) && limit=$left
    printf '\n######## step %s (at %d s, budget %d s)\n' "$title" "$SECONDS" "$limit"
    if ((limit < 15)); then
        verdict="FAIL (no time left)"
    else
        timeout -k 10 "$limit" bash "$SELF" --step "$name"
        rc=$?
        if ((rc == 124 || rc == 137)); then
            verdict="FAIL (timed out after $limit s)"
        elif ((rc != 0)); then
            verdict="FAIL (exit $rc)"
        fi
    fi
    echo "---- step $title: $verdict, $((SECONDS - start)) s"
    RESULTS+=("$(printf '%-46s %s, %d s' "$title" "$verdict" "$((SECONDS - start))")")
}

main() {
    mkdir -p "$WORK"
    exec > >(tee "$LOG") 2>&1
    echo "srt GPU check, $(date -u +%FT%TZ): budget $TOTAL s; log $LOG"
    # The 6 GB checkpoint of steps 6 and 8 and its 3.7 GB fp8 copy (step 7b), written (random
    # weights, on the CPU) while the steps before them run: few threads, to leave the cores to
    # Triton's compiler; none of the wheels, which step 1 may be installing at that moment.
    rm -f "$FIGURES" # a figure of an earlier run is no baseline
    OMP_NUM_THREADS=4 PYTHONPATH="$PWD:$PWD/launch" "$PY" benchmark/offline/make_random_model.py \
        --out-dir "$BIG" --preset "$PRESET" --fp8-copy "$FP8" >"$WORK/make_model.log" 2>&1 &
    export WRITER=$!
    run_step "1 setup: wheels, versions, tiny checkpoints" 30 setup
    run_step "2a GPU tests (pytest -m gpu)" 45 gpu_tests
    run_step "2b Triton kernel tests on the GPU" 75 triton_tests
    run_step "3 fp32 parity with HF transformers" 60 parity
    run_step "4 bf16 greedy: CUDA graphs == eager" 35 graphs
    run_step "5 decode under forbid_host_sync" 30 nosync
    run_step "6 decode figures, Qwen3-30B-A3B-shaped" 150 report
    run_step "7a fp8 kernels; tiny fp8 vs dequantized" 75 fp8_parity
    run_step "7b fp8 decode figures, beside step 6" 75 fp8_report
    run_step "8 served tok/s, concurrency 32" 60 serve
    kill "$WRITER" 2>/dev/null
    wait "$WRITER" 2>/dev/null
    printf '\n######## summary (%d s)\n' "$SECONDS"
    printf '%s\n' "${RESULTS[@]}"
    echo "log: $LOG"
    [[ "${RESULTS[*]}" != *FAIL* ]]
}

if [ "${1:-}" = --step ]; then
    "step_$2"
    exit
fi
main
