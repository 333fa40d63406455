#!/usr/bin/env bash
# The GPU path, checked end to end, for whoever has a CUDA machine.
#
# UNVERIFIED until someone runs it on a GPU: it was written on a CPU-only machine, where only
# its dry run has run (docs/testing.md). Expect the first GPU run to find things to fix.
#
#   bash scripts/gpu_check.sh             # a CUDA machine: the whole check
#   bash scripts/gpu_check.sh --dry-run   # any machine: the CPU-side plumbing (CI runs it)
#
# Steps, each recorded in $OUT/steps.jsonl (status, seconds, log), then one JSON summary on stdout
# (also $OUT/summary.json); the exit status is 0 only if every step passed:
#   1. install   SMURFS_EXTRAS=gpu,test,bench,ray bash scripts/setup.sh
#   2. identity  the greedy token-for-token end-to-end tests, batch-invariant
#                (VLLM_BATCH_INVARIANT=1, which tests/e2e/conftest.py also chooses on a GPU)
#   3. serve     `vllm serve` with the default Smurfs configuration (a drafter and the n-gram
#                voter) on the prepared models: one greedy completion and the /metrics counters
#   4. bench     a Spec-Bench quick pass of none, ngram k4, draft_model k2 and Smurfs k4, at
#                batch 1 and at 16 concurrent requests (`python -m benchmarks run --quick`)
#   5. summary   one JSON object: the steps and, per method and load point, speedup, mean
#                acceptance length and identity with no speculation
#
# Environment:
#   SMURFS_TARGET, SMURFS_DRAFT  the models (default: python ../shared/models/prepare_models.py,
#                                the prepared Qwen2.5-Coder 1.5B target and 0.5B draft)
#   GPU_CHECK_OUT                the output folder (default benchmarks/results/tmp/gpu-check-TIME)
#
# --dry-run (CPU, about a minute): 1 checks that pyproject.toml declares the extras (no pip); 2
# collects the identity tests in the GPU environment (not run: CI runs them anyway); 3 serves the
# tiny test models (or SMURFS_TARGET / SMURFS_DRAFT) on the CPU build in float32 and answers one
# completion, as on the GPU; 4 parses the exact benchmark command line with the benchmark's own
# parser (not run); 5 as on the GPU, and reads a committed benchmark result to check the reader.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
    esac
done
OUT="${GPU_CHECK_OUT:-$ROOT/benchmarks/results/tmp/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/logs"
: >"$OUT/steps.jsonl"
PY="${SMURFS_VENV:-$ROOT/.venv}/bin/python"
IDENTITY_TESTS=(tests/e2e/test_greedy_lossless.py)
FAILED=0

log() { echo "[gpu_check] $*" >&2; }

# step NAME COMMAND...: run it, its output in $OUT/logs/NAME.log; the last line of its stdout, if
# it is a JSON object, is the step's record (a helper of smurfs_tools.gpu_check prints one).
step() {
    local name="$1"; shift
    local started rc record
    log "$name: $*"
    started=$(date +%s)
    "$@" >"$OUT/logs/$name.out" 2>"$OUT/logs/$name.log"
    rc=$?
    record="$(tail -n 1 "$OUT/logs/$name.out" 2>/dev/null)"
    [[ "$record" == "{"* ]] || record="{}"
    "$PY" - "$name" "$rc" "$(( $(date +%s) - started ))" "$DRY_RUN" "$record" \
        "$OUT/logs/$name.log" >>"$OUT/steps.jsonl" <<'EOF'
import json, sys
name, rc, seconds, dry, record, log = sys.argv[1:]
record = json.loads(record)
print(json.dumps({"step": name, "ok": int(rc) == 0 and record.get("ok", True),
                  "exit_code": int(rc), "seconds": int(seconds), "dry_run": dry == "1",
                  "log": log, **{k: v for k, v in record.items() if k != "ok"}}))
EOF
    if [[ $rc -ne 0 ]]; then
        FAILED=1
        log "$name FAILED (exit $rc; see $OUT/logs/$name.log)"
    fi
    return $rc
}

# -- 1. install ----------------------------------------------------------------------------------
if [[ $DRY_RUN == 1 ]]; then
    step install "$PY" -m smurfs_tools.gpu_check extras
else
    step install env SMURFS_EXTRAS=gpu,test,bench,ray bash scripts/setup.sh || {
        cat "$OUT/steps.jsonl"; exit 1; }
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        log "no CUDA device visible to torch: this is the GPU check (--dry-run runs on CPU)"
        exit 1; }
fi

# -- 2. identity ---------------------------------------------------------------------------------
if [[ $DRY_RUN == 1 ]]; then
    # The environment the GPU run gets (what tests/e2e/conftest.py sets there), and the tests.
    env_json="$("$PY" -m smurfs_tools.gpu_check identity-env cuda)"
    eval "$("$PY" -c 'import json,shlex,sys; print(" ".join("export %s=%s" % (k, shlex.quote(v)) for k, v in json.loads(sys.argv[1])["env"].items()))' "$env_json")"
    step identity "$PY" -m pytest --collect-only -q "${IDENTITY_TESTS[@]}"
    unset VLLM_BATCH_INVARIANT
else
    step identity env VLLM_BATCH_INVARIANT=1 bash scripts/test.sh "${IDENTITY_TESTS[@]}"
fi

# -- 3. serve ------------------------------------------------------------------------------------
if [[ $DRY_RUN == 1 ]]; then
    TINY="$OUT/tiny-models"
    "$PY" -c "from smurfs_tools.tiny_models import build_tiny_family as b; b('$TINY', num_drafts=1)" \
        >"$OUT/logs/tiny-models.log" 2>&1 || { log "could not build the tiny models"; exit 1; }
    TARGET="${SMURFS_TARGET:-$TINY/target}"; DRAFT="${SMURFS_DRAFT:-$TINY/draft-0}"
    DTYPE=float32; MAX_LEN=512
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
else
    if [[ -z "${SMURFS_TARGET:-}" || -z "${SMURFS_DRAFT:-}" ]]; then
        mapfile -t MODELS < <("$PY" ../shared/models/prepare_models.py)
        SMURFS_TARGET="${SMURFS_TARGET:-${MODELS[0]:-}}"; SMURFS_DRAFT="${SMURFS_DRAFT:-${MODELS[1]:-}}"
    fi
    TARGET="$SMURFS_TARGET"; DRAFT="$SMURFS_DRAFT"; DTYPE=bfloat16; MAX_LEN=4096
fi
step serve "$PY" -m smurfs_tools.gpu_check serve --target "$TARGET" --draft "$DRAFT" \
    --dtype "$DTYPE" --max-model-len "$MAX_LEN" --log "$OUT/logs/vllm-serve.log"

# -- 4. bench ------------------------------------------------------------------------------------
BENCH=(--target "$TARGET" --draft "$DRAFT" --quick --methods none,ngram:4,draft_model:2,smurfs:4
       --loads batch1,served --concurrency 16 --dtype bfloat16 --out "$OUT/bench")
if [[ $DRY_RUN == 1 ]]; then
    step bench "$PY" -m smurfs_tools.gpu_check bench-args -- run "${BENCH[@]}"
else
    step bench "$PY" -m benchmarks run "${BENCH[@]}"
fi

# -- 5. summary ----------------------------------------------------------------------------------
READER=()
if [[ $DRY_RUN == 1 ]]; then
    READER=(--bench-result benchmarks/results/2026-12-05-ray/batch1/pass-1/result.json)
fi
"$PY" -m smurfs_tools.gpu_check summary "$OUT" "${READER[@]}" | tee "$OUT/summary.json"
summary_rc=${PIPESTATUS[0]}
[[ $FAILED == 0 && $summary_rc == 0 ]]
