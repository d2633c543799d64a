#!/usr/bin/env bash
# Issue 43's runs on the lent GPU machine, in one call (after the budget curve's cells, which come first):
#   step_time  bench/step_time.py --layers 4 --ranks 1 --steps 8: Gemma-2-27B cut to 4 decoder layers (--random_init
#              --freeze_embeddings, seqlen 2048, batch 1, 90 %) under zero3_offload and zero3_offload_elsal: s/step,
#              the host RSS peak of the job's processes and the GPU allocator's peak, each beside elsa-estimate's
#   refuse     the issue's 8-layer ELSA-L job (killed by the kernel at e23227a): the pre-flight check must refuse it,
#              exit 2 and one line naming what does not fit and what would, the output directory never made
#   oom        the same job with --ignore_memory_check: the kernel's out-of-memory killer ends it; the launcher's
#              one line (phase reached, memory seen) and the output directory as it was; host memory sampled each second
# Each step writes $OUT/<step>.log and one JSON line to $OUT/scale.jsonl, inside caps of 330 / 60 / 180 s. --dry-run (here, on CPU): step_time on the
# demo model (one config, 2 steps), the same 8-layer refusal (this box has less memory still), no oom (it would
# exhaust this box: the killed-rank path is tests/test_killed.py's).
#
#   bench/device/scale.sh --dry-run                                      # here (tests/test_device_kit.py)
#   run  command: bench/device/scale.sh   carry: ["bench/device/wheels"]   timeout_s: 600     # there
#   SCALE_STEPS=refuse,oom bench/device/scale.sh                         # some steps only (a loan's last minutes)
set -uo pipefail
STEPS=",${SCALE_STEPS:-step_time,refuse,oom},"
wants() { [[ "$STEPS" == *",$1,"* ]]; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT="${OUT:-$ROOT/out/device_scale}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
SITE="${SITE:-/tmp/elsa_ds_site}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
exec > >(tee -a "$OUT/log") 2>&1

if (( DRY )); then
    TIME_ARGS=(--configs ds_configs/zero3_offload.json --steps 2 --interval 2 --profile 0:1)
else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" bench/device/wheels/*.whl
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" DS_ACCELERATOR=cuda
    TIME_ARGS=(--layers 4 --steps 8 --interval 4 --profile 4:1)  # step 4 profiled (5: cProfile), between projections
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
LAUNCHER="$(command -v deepspeed || echo deepspeed)"

note() {  # note STEP RC SECONDS [JSON fields...]: one line of scale.jsonl
    local step=$1 rc=$2 seconds=$3
    shift 3
    "$PY" - "$OUT/scale.jsonl" "$step" "$rc" "$seconds" "$@" <<'EOF'
import json, sys
path, step, rc, seconds, *fields = sys.argv[1:]
row = {"step": step, "rc": int(rc), "seconds": int(seconds)}
for field in fields:
    row.update(json.loads(field))
with open(path, "a") as fh:
    fh.write(json.dumps(row) + "\n")
EOF
}

# the 8-layer job of the issue, as it ran there (its flags: bench/step_time.py --layers builds the same model)
"$PY" -c "import sys; sys.path.insert(0, 'bench'); from scale import build_model_dir; from pathlib import Path; \
build_model_dir(Path(sys.argv[1]), 8)" "$WORK/g27_8" || exit 1
JOB8=(--num_gpus 1 launch/prune.py --deepspeed ds_configs/zero3_offload_elsal.json --model "$WORK/g27_8" --random_init
      --freeze_embeddings --dataset shakespeare --seqlen 2048 --micro_batch 1 --batch_size 1 --steps 8 --interval 4
      --sparsity 0.9 --init_mask none --val_windows 0 --baseline none)

if wants step_time; then
    echo "=== step_time"
    t0=$SECONDS
    timeout -k 10 330 "$PY" bench/step_time.py --ranks 1 "${TIME_ARGS[@]}" --out "$WORK/time" --json > "$OUT/step_time.log" 2>&1
    rc=$?
    cat "$OUT/step_time.log"
    note step_time "$rc" $((SECONDS - t0)) "$(tail -n 1 "$OUT/step_time.log" | grep '^{' || echo '{}')"
fi

settle() {  # until the job's processes have ended (<= 45 s): the deepspeed command returns on a stop before its ranks
    # have finished their way out (their lock goes last), so what is left is looked at once they are gone
    local i
    for i in $(seq 45); do pgrep -f -- "--output_dir $WORK/out8" > /dev/null || return 0; sleep 1; done
}

outcome() {  # outcome LOG PATTERN: its first line matching, whether $WORK/out8 was made, what was left beside it
    "$PY" - "$(grep -m 1 "$2" "$1" || true)" "$WORK" <<'EOF'
import json, sys
from pathlib import Path
line, work = sys.argv[1], Path(sys.argv[2])
print(json.dumps({"line": line, "output_made": (work / "out8").exists(),
                  "left_behind": sorted(p.name for p in work.iterdir() if p.name.startswith(".out8"))}))
EOF
}

if wants refuse; then
    echo "=== refuse"
    t0=$SECONDS
    timeout -k 10 60 "$LAUNCHER" "${JOB8[@]}" --output_dir "$WORK/out8" > "$OUT/refuse.log" 2>&1
    rc=$?
    settle
    note refuse "$rc" $((SECONDS - t0)) "$(outcome "$OUT/refuse.log" 'elsa_ds: error:')"
    tail -n 1 "$OUT/scale.jsonl"
fi

if (( ! DRY )) && wants oom; then
    echo "=== oom"
    (while :; do free -b | awk '/^Mem:/ {print $3}'; sleep 1; done) > "$WORK/used" &
    sampler=$!
    t0=$SECONDS
    timeout -k 10 180 "$LAUNCHER" "${JOB8[@]}" --ignore_memory_check --output_dir "$WORK/out8" > "$OUT/oom.log" 2>&1
    rc=$?
    settle
    kill "$sampler" 2>/dev/null
    note oom "$rc" $((SECONDS - t0)) "$(outcome "$OUT/oom.log" 'elsa_ds: error: the job')" \
        "{\"host_used_peak_bytes\": $(sort -n "$WORK/used" | tail -n 1), \"host_total_bytes\": $(free -b | awk '/^Mem:/ {print $2}')}"
    tail -n 1 "$OUT/scale.jsonl"
fi
echo "=== done in $SECONDS s; $OUT/scale.jsonl"
cat "$OUT/scale.jsonl"
