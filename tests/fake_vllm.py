"""vLLM's real ``_custom_ops.py`` from each family's wheel, importable without the rest of vLLM.

``custom_ops_source(version)`` downloads ``vllm==version`` with ``pip download --no-deps`` once and
keeps only ``vllm/_custom_ops.py`` under ``$BIV100_VLLM_ENVS/custom_ops/<version>/`` (default
.ci/envs). ``make_site(directory, version, source)`` lays out a tiny ``vllm`` package holding that
file, stub modules for what it imports from the rest of vLLM (logger, envs, platforms,
scalar_type, utils) and a ``vllm-<version>.dist-info`` so ``importlib.metadata`` reports the
version. ``imported(site)`` imports ``vllm._custom_ops`` from there and cleans up afterwards
(reverting the patch first). There is no ``vllm._C``: the module's ``import vllm._C`` fails the
way it does on a machine without vLLM's CUDA extension.
"""

import concurrent.futures
import contextlib
import importlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
FAMILY_WHEELS = {  # version -> expected family (None: nothing to patch), hint_on_error wrappers
    "0.4.2": ("0.4.2", False),
    "0.4.3": ("0.4.3-0.5.2", False),
    "0.5.2": ("0.4.3-0.5.2", True),
    "0.5.3": ("0.5.3-0.6.6", True),
    "0.6.6": ("0.5.3-0.6.6", False),
    "0.7.0": ("0.7.0-0.24.x", False),
    "0.24.0": ("0.7.0-0.24.x", False),
    "0.25.0": (None, False),
}

_STUBS = {
    "vllm/__init__.py": "",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/envs.py": "def __getattr__(name):\n    return None\n",
    "vllm/platforms/__init__.py": ("class _Platform:\n    def __getattr__(self, name):\n"
                                   "        return lambda *args, **kwargs: False\n\ncurrent_platform = _Platform()\n"),
    "vllm/scalar_type.py": "class ScalarType:\n    pass\n\ndef __getattr__(name):\n    return ScalarType\n",
    "vllm/utils/__init__.py": "def __getattr__(name):\n    return lambda *args, **kwargs: None\n",
    "vllm/utils/flashinfer.py": "def __getattr__(name):\n    return lambda *args, **kwargs: None\n",
    "vllm/utils/math_utils.py": "def cdiv(a, b):\n    return -(-a // b)\n\ndef round_up(x, y):\n    return cdiv(x, y) * y\n",
}


def envs_root():
    return pathlib.Path(os.environ.get("BIV100_VLLM_ENVS", REPO_ROOT / ".ci" / "envs"))


def missing(message):
    """In CI a missing environment is a failure, elsewhere a skip."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _fetch(version):
    target = envs_root() / "custom_ops" / version / "_custom_ops.py"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as download:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                                 f"vllm=={version}", "-d", download], capture_output=True, text=True)
        wheels = list(pathlib.Path(download).glob("vllm-*.whl"))
        if result.returncode or not wheels:
            raise RuntimeError(f"pip download vllm=={version} failed: {result.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            text = wheel.read("vllm/_custom_ops.py")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(text)
    os.replace(partial, target)
    return target


def fetch_all(versions):
    """``{version: path of its _custom_ops.py}``, downloading the missing ones four at a time."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {version: pool.submit(_fetch, version) for version in versions}
    found, errors = {}, []
    for version, future in futures.items():
        try:
            found[version] = future.result()
        except Exception as error:
            errors.append(f"{version}: {error}")
    if errors:
        missing("could not get vLLM wheels' _custom_ops.py: " + "; ".join(errors))
    return found


def make_site(directory, version, source):
    """A directory for sys.path holding vllm (``source`` as vllm/_custom_ops.py) as version ``version``."""
    directory = pathlib.Path(directory)
    for relative, text in _STUBS.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (directory / "vllm" / "_custom_ops.py").write_text(pathlib.Path(source).read_text()
                                                         if isinstance(source, pathlib.Path) else source)
    info = directory / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return directory


def _forget_vllm():
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


@contextlib.contextmanager
def imported(site):
    """``vllm._custom_ops`` imported from ``site``; afterwards the patch is reverted and vllm forgotten."""
    from biv100_patch import patches
    _forget_vllm()
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield importlib.import_module("vllm._custom_ops")
    finally:
        patches.revert()
        sys.path.remove(str(site))
        _forget_vllm()
        importlib.invalidate_caches()


@pytest.fixture
def fresh_patcher(monkeypatch, tmp_path):
    """The patcher as in a new process: no state, no warnings given, a private state directory."""
    apply_module = importlib.import_module("biv100_patch.patches.apply")
    apply_module.revert()
    monkeypatch.setattr(apply_module, "_state", {"status": "idle", "reason": "apply() has not been called"})
    monkeypatch.setattr(apply_module, "_warned", set())
    monkeypatch.setattr(apply_module, "_announced", False)
    monkeypatch.setenv("BIV100_PATCH_HOME", str(tmp_path / "state"))
    for name in ("BIV100_PATCH", "BIV100_PATCH_BACKEND", "BIV100_PATCH_STRICT", "BIV100_PATCH_VALIDATE"):
        monkeypatch.delenv(name, raising=False)
    yield apply_module
    apply_module.revert()


def family_arguments(family, op, case, out, buffers=None):
    """Positional arguments of ``vllm._custom_ops.<op>`` in ``family``'s convention (scales 1.0)."""
    import torch
    head = [out] + (list(buffers) if op == "paged_attention_v2" else []) + [
        case["query"], case["key_cache"], case["value_cache"], case["num_kv_heads"], case["scale"],
        case["block_tables"], case["seq_lens"], case["block_size"], case["max_seq_len"], case["alibi_slopes"],
        case["kv_cache_dtype"]]
    if family in ("0.4.2", "0.4.3-0.5.2"):
        scales = [1.0]
    elif family == "0.5.3-0.6.6":
        scales = [1.0, 1.0]
    else:
        scales = [torch.tensor(1.0, dtype=torch.float32)] * 2
    tail = [] if family == "0.4.2" else [0, 0, 0, 64, 0]
    return head + scales + tail


def v2_buffers(case):
    import math

    import torch
    num_seqs, num_heads, head_size = case["query"].shape
    partitions = math.ceil(case["max_seq_len"] / 512)
    exp_sums = torch.full((num_seqs, num_heads, partitions), math.nan, dtype=torch.float32)
    return exp_sums, exp_sums.clone(), torch.full((num_seqs, num_heads, partitions, head_size), math.nan,
                                                  dtype=case["query"].dtype)


_TAIL = ("tp_rank: int = 0, blocksparse_local_blocks: int = 0, blocksparse_vert_stride: int = 0, "
         "blocksparse_block_size: int = 64, blocksparse_head_sliding_step: int = 0")
_HEAD = ("query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len, "
         "alibi_slopes, kv_cache_dtype")


def synthetic_custom_ops(v2_extra=""):
    """A 0.5.3-0.6.6-style ``_custom_ops.py`` (float k/v scales, hint_on_error wrappers) whose ops
    fail like vLLM's do without its CUDA extension; ``v2_extra`` adds parameters to v2."""
    return f'''import functools


def hint_on_error(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def paged_attention_v1(out, {_HEAD}, k_scale: float, v_scale: float, {_TAIL}) -> None:
    raise AttributeError("vllm._C has no paged_attention_v1 on this machine")


def paged_attention_v2(out, exp_sum, max_logits, tmp_out, {_HEAD}, k_scale: float, v_scale: float, {_TAIL}
                       {v2_extra}) -> None:
    raise AttributeError("vllm._C has no paged_attention_v2 on this machine")


paged_attention_v1 = hint_on_error(paged_attention_v1)
paged_attention_v2 = hint_on_error(paged_attention_v2)
'''
