#!/usr/bin/env bash
# Build a CPU-only virtual environment holding vLLM's own Python code, for the patcher's tests.
#
#   .ci/make_vllm_env.sh VERSION DEST
#
# CPU torch 2.13.0 (the file on disk), the packages VERSION's `vllm._custom_ops` and
# `vllm.attention.ops.paged_attn` need, `pip install --no-deps vllm==VERSION` (never with deps:
# they would replace torch with a CUDA build) and this repository, editable. Idempotent: a DEST
# that exists and imports is left alone. Quiet; prints one line with the seconds it took.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 VERSION DEST" >&2
    exit 2
fi
version=$1
dest=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
started=$SECONDS
source "$repo/.ci/env_common.sh"

# Read from each release's imports on CPU torch 2.13 (see shared/notes/vllm-paged-attention.md).
case $version in
    # transformers pinned: 5.x imports PyPI's `kernels`, which this repository's kernels/ shadows wherever the
    # checkout is on sys.path (pytest's rootdir, python -c here).
    0.6.3) packages=("triton==3.0.0" "numpy<2" "transformers==4.46.3" psutil msgspec pyyaml pyzmq "gguf==0.10.0" sentencepiece
                     cloudpickle mistral_common py-cpuinfo aiohttp openai) ;;
    0.7.3) packages=(pydantic transformers cloudpickle psutil pyzmq msgspec pillow blake3 openai aiohttp requests
                     py-cpuinfo) ;;
    # triton 3.6.0 too: the Triton backend's vLLM test runs here (triton 3.0.0's interpreter, 0.6.3's, cannot run it).
    0.9.2) packages=("transformers==4.53.3" cachetools cloudpickle psutil pyzmq msgspec pillow blake3 pybase64
                     pydantic "triton==3.6.0") ;;
    0.10.1.1) packages=(transformers cachetools cbor2 cloudpickle psutil setproctitle pyzmq msgspec pillow blake3
                        pybase64 pydantic) ;;
    *) echo "$0: no package list for vLLM $version (known: 0.6.3 0.7.3 0.9.2 0.10.1.1)" >&2; exit 2 ;;
esac
# biv100-patch's own requirements (it is installed with --no-deps below).
packages+=(click packaging platformdirs filelock)
# Extra packages for one environment, e.g. VLLM_ENV_EXTRA="triton==3.6.0" for the Triton backend's tests.
read -r -a extra <<< "${VLLM_ENV_EXTRA:-}"

works() {  # cheap: the full import check ran once, before the marker was written
    [ -x "$dest/bin/python" ] && [ -f "$dest/.biv100-env-ok" ] && "$dest/bin/python" - "$version" "$repo" <<'EOF' >/dev/null 2>&1
import importlib.metadata, importlib.util, os, sys
assert importlib.metadata.version("vllm") == sys.argv[1]
assert all(importlib.util.find_spec(name) for name in ("click", "packaging", "platformdirs", "filelock"))
spec = importlib.util.find_spec("biv100_patch.patches")
assert os.path.realpath(spec.submodule_search_locations[0]) == os.path.realpath(os.path.join(sys.argv[2], "patches"))
EOF
}

imports() {
    "$dest/bin/python" -c "import biv100_patch.patches, torch, vllm._custom_ops, vllm.attention.ops.paged_attn" \
        >/dev/null 2>"$dest/.import-errors" && rm -f "$dest/.import-errors"
}

if works; then
    echo "vLLM $version env at $dest: ready ($((SECONDS - started)) s)"
    exit 0
fi

rm -rf "$dest"
"$python" -m venv "$dest"
pip_install torch==2.13.0 "${packages[@]}" "${extra[@]}"
pip_install --no-deps "vllm==$version"
site=$("$dest/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$version" = 0.6.3 ]; then
    # The compiled extensions cannot load without CUDA, and a present but failing _core_C breaks vllm._core_ext.
    rm -f "$site"/vllm/*.so
fi
install_checkout
if ! imports; then
    echo "$0: the vLLM $version env at $dest does not import vllm._custom_ops; see $dest/.import-errors" >&2
    exit 1
fi
touch "$dest/.biv100-env-ok"
echo "vLLM $version env at $dest: built in $((SECONDS - started)) s"
