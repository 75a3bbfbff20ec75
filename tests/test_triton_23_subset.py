"""The Triton kernels use only what Triton 2.3.1's language has (the BI-V100's vendor Triton).

Every ``tl.NAME`` / ``tl.math.NAME`` the kernel module uses, and every keyword it passes to one,
is looked up in a real triton==2.3.1: .ci/run installs it (``pip install --no-deps --target
.ci/envs/triton231 triton==2.3.1``); nothing is installed here. Its ``triton.language`` is imported
in a subprocess with that folder first on sys.path (it imports without a GPU or libcuda).
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TRITON_231 = REPO_ROOT / ".ci" / "envs" / "triton231"
KERNEL_MODULES = [REPO_ROOT / "kernels" / "paged_attention_triton.py"]
# Used only in constexpr branches that Triton 2.x never compiles: KEY_ROWS is set only where
# configs.triton_has_permute() (test_paged_attention_triton's test_key_rows_only_on_the_pipelined_dot_path).
TRITON_3_ONLY = {"tl.permute"}

_LOOKUP = r"""
import inspect, json, sys
sys.path.insert(0, sys.argv[1])
import triton, triton.language as tl
wanted = json.loads(sys.stdin.read())
found = {"version": triton.__version__, "file": triton.__file__, "missing": [], "bad_keywords": []}
for dotted, keywords in wanted.items():
    obj = tl
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if obj is None:
        found["missing"].append(dotted)
        continue
    fn = getattr(obj, "__wrapped__", obj)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        continue
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        found["bad_keywords"] += [f"{dotted}({k}=)" for k in keywords if k not in params]
print(json.dumps(found))
"""


def used_names(path):
    """{"tl.name" or "tl.math.name": set of keywords passed to it} for every use in the module."""
    tree = ast.parse(path.read_text())
    names = {}

    def dotted(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "tl":
            parts.append("tl")
            return ".".join(reversed(parts))
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if name and not isinstance(getattr(node, "ctx", None), ast.Store):
                # tl.float32.x never occurs; keep tl.NAME and tl.math.NAME
                names.setdefault(".".join(name.split(".")[:3] if name.startswith("tl.math.") else
                                          name.split(".")[:2]), set())
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name:
                names.setdefault(name, set()).update(k.arg for k in node.keywords if k.arg)
    names.pop("tl.math", None)
    return names


def test_the_scan_sees_the_kernels_calls():
    names = used_names(KERNEL_MODULES[0])
    assert {"tl.load", "tl.store", "tl.dot", "tl.math.exp2", "tl.program_id", "tl.where"} <= set(names)
    assert "allow_tf32" in names["tl.dot"]


@pytest.mark.skipif(not (TRITON_231 / "triton").is_dir(),
                    reason=f"triton 2.3.1 not installed in {TRITON_231} (.ci/run installs it)")
def test_kernels_use_only_triton_231_language():
    wanted = {}
    for path in KERNEL_MODULES:
        for name, keywords in used_names(path).items():
            wanted.setdefault(name, set()).update(keywords)
    result = subprocess.run([sys.executable, "-c", _LOOKUP, str(TRITON_231)],
                            input=json.dumps({k: sorted(v) for k, v in wanted.items()}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert found["version"] == "2.3.1" and pathlib.Path(found["file"]).is_relative_to(TRITON_231), found
    assert set(found["missing"]) == TRITON_3_ONLY, f"not in triton 2.3.1's language: {found['missing']}"
    assert not found["bad_keywords"], f"keywords triton 2.3.1 does not take: {found['bad_keywords']}"
    # The names the issue lists as absent from 2.3.1 really are absent there (the check has teeth).
    probe = {"tl.exp2": [], "tl.range": [], "tl.cast": [], "tl.math.exp2": []}
    result = subprocess.run([sys.executable, "-c", _LOOKUP, str(TRITON_231)], input=json.dumps(probe),
                            capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout)["missing"] == ["tl.exp2", "tl.range", "tl.cast"]
