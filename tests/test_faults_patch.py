"""Faults the patcher owns (issue 6: 4, 6, 7, 8): each leaves the process working, says why once, records it."""

import json
import logging
import math
import subprocess
import sys

import pytest
import torch

from biv100_patch import kernels
from biv100_patch.kernels import PagedAttentionBackend
from tests import fake_vllm
from tests.fake_vllm import family_arguments, fresh_patcher, v2_buffers  # noqa: F401 (fixture)
from tests.reference import reference_attention
from tests.test_patch_runtime import FlakyTriton
from tests.vllm_patch_check import make_case


def patcher_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "biv100_patch" and r.levelno == logging.WARNING]


def test_4_compile_error_at_call_time_for_a_new_shape(fresh_patcher, tmp_path, monkeypatch, caplog):  # noqa: F811
    flaky = FlakyTriton(failing_head_size=80)
    real_get_backend = kernels.get_backend

    def get_backend(name, **options):
        return PagedAttentionBackend("triton", flaky.forward) if name == "triton" else real_get_backend(name,
                                                                                                          **options)
    monkeypatch.setattr(kernels, "get_backend", get_backend)
    site = fake_vllm.make_site(tmp_path / "site", "0.6.3+corex.3.2.3", fake_vllm.synthetic_custom_ops())
    with fake_vllm.imported(site) as module:
        assert fresh_patcher.apply("triton")["backend"] == "triton"
        case = make_case(torch, torch.float32, [30, 700], head_size=80)
        expected = reference_attention(**case)["out"]
        for _ in range(2):
            out = torch.full_like(case["query"], math.nan)
            module.paged_attention_v2(*family_arguments("0.5.3-0.6.6", "paged_attention_v2", case, out,
                                                        v2_buffers(case)))
            assert (out.double() - expected).abs().max().item() < 1e-4
        assert flaky.calls == 1  # the second call went straight to torch
        [warning] = patcher_warnings(caplog)
        assert "the triton backend failed" in warning and "CompileError" in warning
        [routed] = fresh_patcher.state()["routed_to_torch"]
        assert routed["shape"][:3] == ["v2", "float32", 80] and routed["error"].startswith("CompileError")
    events = [json.loads(line) for path in (tmp_path / "state").rglob("events-*.jsonl")
              for line in path.read_text().splitlines()]
    [event] = [e for e in events if e["kind"] == "runtime_fallback"]
    assert event["details"]["shape"]["head_size"] == 80 and event["details"]["to"] == "torch"


def test_6_vllm_missing(tmp_path):
    script = (
        "import json, sys\n"
        "import biv100_patch.patches as patches\n"
        "first, second = patches.apply(), patches.apply('torch')\n"
        "print(json.dumps({'first': first, 'second': second, 'state': patches.state(),\n"
        "                  'vllm_imported': any(n.split('.')[0] == 'vllm' for n in sys.modules),\n"
        "                  'finder': [type(f).__name__ for f in sys.meta_path]}))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "BIV100_PATCH_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["first"] == {"backend": "off", "reason": "vLLM is not installed: nothing to patch",
                               "source": "vllm"}
    assert report["second"]["backend"] == "off"
    assert report["state"]["status"] == "skipped"
    assert not report["vllm_imported"] and "CustomOpsFinder" not in report["finder"]
    assert result.stderr.strip().splitlines() == ["biv100-patch: vLLM is not installed: nothing to patch"]


@pytest.mark.parametrize("version, reason", [
    ("0.26.0", "has no paged_attention_v1/v2 (removed in 0.25)"),
    ("0.4.1", "is older than 0.4.2"),
    ("0.30.0rc1+corex.5.0", "removed in 0.25"),
])
def test_7_vllm_outside_the_supported_range(version, reason, fresh_patcher, tmp_path, caplog):  # noqa: F811
    site = fake_vllm.make_site(tmp_path / "site", version, fake_vllm.synthetic_custom_ops())
    with fake_vllm.imported(site) as module:
        originals = (module.paged_attention_v1, module.paged_attention_v2)
        for _ in range(2):
            decision = fresh_patcher.apply()
            assert decision["backend"] == "off" and reason in decision["reason"]
        state = fresh_patcher.state()
        assert state["status"] == "skipped" and reason in state["reason"] and state["vllm_version"] == version
        assert (module.paged_attention_v1, module.paged_attention_v2) == originals
        assert not hasattr(torch.ops._C, "paged_attention_v1")
        assert len(patcher_warnings(caplog)) == 1 and reason in patcher_warnings(caplog)[0]


def test_8_op_with_an_unexpected_signature(fresh_patcher, tmp_path, caplog):  # noqa: F811
    source = fake_vllm.synthetic_custom_ops(v2_extra=", k_zero_point: float = 0.0")
    site = fake_vllm.make_site(tmp_path / "site", "0.6.3", source)
    with fake_vllm.imported(site) as module:
        originals = (module.paged_attention_v1, module.paged_attention_v2)
        decision = fresh_patcher.apply("torch")
        fresh_patcher.apply("torch")
        assert decision["backend"] == "off"
        state = fresh_patcher.state()
        assert state["status"] == "skipped" and state["family"] is None
        assert "unexpected signature" in state["reason"] and "k_zero_point" in state["reason"]
        assert (module.paged_attention_v1, module.paged_attention_v2) == originals
        assert not hasattr(torch.ops._C, "paged_attention_v2")
        [warning] = patcher_warnings(caplog)
        assert "k_zero_point" in warning


def test_8_scale_annotation_contradicting_the_version(fresh_patcher, tmp_path):  # noqa: F811
    # A "0.9.2" whose ops still take float scales: the version says Tensor, the signature says float.
    site = fake_vllm.make_site(tmp_path / "site", "0.9.2", fake_vllm.synthetic_custom_ops())
    with fake_vllm.imported(site):
        fresh_patcher.apply("torch")
        state = fresh_patcher.state()
        assert state["status"] == "skipped"
        assert "k_scale is annotated float, the 0.7.0-0.24.x family passes a tensor" in state["reason"]


EIGHT_APPLIERS = """
import json
from biv100_patch import patches, probe
patches.apply()
import vllm._custom_ops as ops
state = patches.state()
print(json.dumps([ops.paged_attention_v1.__module__, ops.paged_attention_v2.__module__, state["status"],
                  state["backend"], probe.load_decision()["created_unix"]]))
"""


def test_12_eight_processes_apply_at_once_and_all_are_patched(tmp_path):
    """Eight interpreters call apply() together: one probe, one record, and every one of them patched."""
    import os

    site = fake_vllm.make_site(tmp_path / "site", "0.6.3+corex.3.2.3", fake_vllm.synthetic_custom_ops())
    state = tmp_path / "state"
    # No GPU in the children on any machine: the CPU decision (a real GPU probe takes minutes under the suite).
    environment = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{fake_vllm.REPO_ROOT}",
                       BIV100_PATCH_HOME=str(state), CUDA_VISIBLE_DEVICES="")
    for name in ("BIV100_PATCH", "BIV100_PATCH_BACKEND", "BIV100_PATCH_STRICT"):
        environment.pop(name, None)
    workers = [subprocess.Popen([sys.executable, "-c", EIGHT_APPLIERS], cwd=tmp_path, env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    answers = []
    for worker in workers:
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
        answers.append(json.loads(out.strip().splitlines()[-1]))
    assert len({json.dumps(answer) for answer in answers}) == 1
    v1_module, v2_module, status, backend, created = answers[0]
    assert (v1_module, v2_module, status, backend) == (
        "biv100_patch.patches.families", "biv100_patch.patches.families", "patched", "torch")
    [record] = state.glob("probe-*.json")
    assert json.loads(record.read_text())["created_unix"] == created
    assert [name for name in os.listdir(state) if name.endswith(".tmp")] == []
