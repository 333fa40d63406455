#!/usr/bin/env bash
# Run the demo in the project venv (created/refreshed first):
#
#   bash scripts/demo.sh [demo arguments...]
#
# Setup messages go to stderr, so the demo's stdout stays clean.
# SMURFS_VENV selects the venv (default <project root>/.venv), as in setup.sh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SMURFS_VENV:-$ROOT/.venv}"

bash "$ROOT/scripts/setup.sh" >&2

cd "$ROOT"
exec "$VENV/bin/python" -m smurfs_tools.demo "$@"
