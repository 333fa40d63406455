#!/usr/bin/env bash
# Run the test suite in the project venv (created/refreshed first).
#
#   bash scripts/test.sh                    # all of tests/
#   bash scripts/test.sh -m "not e2e"       # extra pytest arguments pass through
#   bash scripts/test.sh tests/unit -x      # a path argument replaces the default tests/
#
# SMURFS_VENV selects the venv (default <project root>/.venv), as in setup.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SMURFS_VENV:-$ROOT/.venv}"

bash "$ROOT/scripts/setup.sh"

cd "$ROOT"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

# Default target tests/, unless an argument already names a test path.
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done

echo "[test] $VENV/bin/python -m pytest ${targets[*]} -q $* (VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE)"
rc=0
"$VENV/bin/python" -m pytest ${targets[@]+"${targets[@]}"} -q "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "[test] ERROR: pytest collected no tests (exit code 5): treated as a failure" >&2
fi
exit "$rc"
