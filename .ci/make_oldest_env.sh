#!/usr/bin/env bash
# Build the oldest stack this package supports, the BI-V100's on the CPU: Python 3.8 (setup.cfg's
# python_requires), torch 2.1.0 (CoreX 3.2.3's torch is 2.1.0+corex), Triton 2.3.1 (its vendor Triton), and
# the newest click, packaging, platformdirs and filelock that Python 3.8 gets.
#
#   .ci/make_oldest_env.sh DEST
#
# PyPI's torch 2.1.0 is a CUDA build (about 2.5 GB with its nvidia-* libraries; it runs on the CPU too).
# Triton 2.3.1 goes in without dependencies: torch 2.1.0 pins triton 2.1.0, which CoreX replaces as well.
# This repository goes in editable, without dependencies. Idempotent: a DEST that imports is left alone.
# Exit status 3: no Python 3.8 here (PYTHON38, python3.8 on PATH or under pyenv's versions).
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi
dest=$1
repo=$(cd "$(dirname "$0")/.." && pwd)
started=$SECONDS
source "$repo/.ci/env_common.sh"

find_python38() {
    local candidate
    for candidate in "${PYTHON38:-}" "$(command -v python3.8 || true)" \
                     "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.8*/bin/python3.8; do
        # (a pyenv shim is on PATH whether or not its version is selected: run it to know)
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 8)' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

imports() {
    "$dest/bin/python" - "$repo" <<'EOF' >/dev/null 2>"$dest/.import-errors" && rm -f "$dest/.import-errors"
import os, sys
import torch, triton
assert torch.__version__.startswith("2.1.0") and triton.__version__ == "2.3.1"
import biv100_patch.patches
assert os.path.realpath(biv100_patch.patches.__path__[0]) == os.path.realpath(os.path.join(sys.argv[1], "patches"))
EOF
}

works() {
    [ -x "$dest/bin/python" ] && [ -f "$dest/.biv100-env-ok" ] && imports
}

if works; then
    echo "oldest-stack env at $dest: ready ($((SECONDS - started)) s)"
    exit 0
fi
if ! python=$(find_python38); then
    echo "$0: no Python 3.8 interpreter (set PYTHON38, or put python3.8 on PATH)" >&2
    exit 3
fi

rm -rf "$dest"
"$python" -m venv "$dest"
pip_install "torch==2.1.0" "numpy<2" "pytest>=7,<9.2" pytest-timeout pytest-xdist click packaging platformdirs filelock
pip_install --no-deps "triton==2.3.1"
install_checkout
if ! imports; then
    echo "$0: the oldest-stack env at $dest does not import torch 2.1.0, triton 2.3.1 and this checkout;" \
         "see $dest/.import-errors" >&2
    exit 1
fi
touch "$dest/.biv100-env-ok"
echo "oldest-stack env at $dest ($("$dest/bin/python" -c 'import sys; print(sys.version.split()[0])')):" \
     "built in $((SECONDS - started)) s"
