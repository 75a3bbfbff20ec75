"""The patch against real vLLM code (CPU): vLLM's own PagedAttention.forward_decode, v1 and v2 paths.

Each vLLM lives in its own venv made by .ci/make_vllm_env.sh under ``$BIV100_VLLM_ENVS``
(default .ci/envs); the check runs there in a subprocess (tests/vllm_patch_check.py) and these
tests assert on its JSON report. With CI=true a missing venv fails the run.

- 0.6.3 (BI-V100's; float scales, hint_on_error wrappers, triton 3.0.0): both backends, with
  ``apply()`` called before vLLM is imported (the patch lands at ``import vllm._custom_ops``).
- 0.9.2 (Tensor scales; triton 3.6.0 added): both backends.
Triton runs under TRITON_INTERPRET=1 in both.
"""

import json
import os
import subprocess

import pytest

from tests import fake_vllm

RUNS = {"0.6.3": (["torch", "triton"], True), "0.9.2": (["torch", "triton"], False)}
FAMILIES = {"0.6.3": "0.5.3-0.6.6", "0.9.2": "0.7.0-0.24.x"}


@pytest.fixture(scope="module", params=list(RUNS))
def vllm_run(request, tmp_path_factory):
    version = request.param
    python = fake_vllm.envs_root() / f"vllm-{version}" / "bin" / "python"
    if not python.exists():
        fake_vllm.missing(f"no vLLM {version} venv at {python.parent.parent}; run .ci/make_vllm_env.sh {version} "
                          f"{python.parent.parent}")
    backends, before_import = RUNS[version]
    command = [str(python), str(fake_vllm.REPO_ROOT / "tests" / "vllm_patch_check.py"), ",".join(backends)]
    if before_import:
        command += ["--apply-before-import", "--verify"]
    env = dict(os.environ, TRITON_INTERPRET="1", BIV100_PATCH_HOME=str(tmp_path_factory.mktemp("state")))
    for name in ("BIV100_PATCH", "BIV100_PATCH_BACKEND", "BIV100_PATCH_STRICT", "BIV100_PATCH_VALIDATE"):
        env.pop(name, None)
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                            cwd=fake_vllm.REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()  # vLLM logs to stdout too: the report is the last line
    return version, backends, json.loads(lines[-1]), result.stderr


def test_forward_decode_v1_and_v2_match_reference(vllm_run):
    version, backends, report, stderr = vllm_run
    for backend in backends:
        run = report[backend]
        assert run["ours"], run
        assert run["state"]["status"] == "patched" and run["state"]["backend"] == backend
        assert run["state"]["family"] == FAMILIES[version] and run["state"]["vllm_version"] == version
        assert run["v1"]["calls"] == ["paged_attention_v1"] and run["v1"]["finite"]
        assert run["v2"]["calls"] == ["paged_attention_v2"] and run["v2"]["finite"]
        assert run["v1"]["max_error"] < 1e-4 and run["v2"]["max_error"] < 1e-4
        assert run["routed_to_torch"] == [], f"{backend} fell back: {run['routed_to_torch']}"


def test_hint_on_error_wrappers_recognised(vllm_run):
    version, backends, report, _ = vllm_run
    wrapped = version == "0.6.3"
    assert report[backends[0]]["originals_wrapped"] == {"paged_attention_v1": wrapped, "paged_attention_v2": wrapped}
    assert report[backends[0]]["state"]["hint_on_error"] is wrapped


def test_torch_ops_direct_call(vllm_run):
    _, backends, report, _ = vllm_run
    for backend in backends:
        run = report[backend]
        # vllm._C cannot load on this machine: we defined the schema so the name exists.
        assert run["dispatcher_state"] == {"dispatch_key": "CPU", "defined": ["paged_attention_v1",
                                                                             "paged_attention_v2"], "replaced": []}
        assert run["torch_ops"]["calls"] == ["paged_attention_v2"], run["torch_ops"]
        assert run["torch_ops"]["max_error"] < 1e-4
        assert run["torch_ops"]["exp_sums_max_rel_error"] < 1e-4
        assert run["torch_ops"]["unwritten_still_nan"]


def test_revert_restores_originals_and_reapply_works(vllm_run):
    _, backends, report, _ = vllm_run
    for backend in backends:
        run = report[backend]
        assert run["revert"] is True and run["restored"] is True
        assert run["state_after_revert"] == "reverted"
        assert run["torch_ops_after_revert"] is False
        assert run["reapply"] == backend and run["reapplied_ours"] is True


def test_apply_before_import_takes_effect_at_import(vllm_run):
    version, _, report, stderr = vllm_run
    if not RUNS[version][1]:  # this run imports vLLM first: nothing was pending
        assert "apply_before_import" not in report and "patched_at_import" not in report
        return
    assert report["apply_before_import"]["source"] == "pending"
    assert report["state_before_import"] == "pending"
    assert report["patched_at_import"] is True and report["state_at_import"] == "patched"
    assert stderr.count("biv100-patch: patched vLLM 0.6.3 (0.5.3-0.6.6 family, hint_on_error wrappers)") <= 1


def test_verify_check_on_vllm_063(vllm_run):
    """What `biv100-patch verify` prints on the BI-V100's vLLM (run in the same process)."""
    version, _, report, _ = vllm_run
    if version != "0.6.3":
        assert "verify" not in report
        return
    assert report["verify"]["ok"] is True
    lines = report["verify"]["lines"]
    assert lines[0] == "vLLM 0.6.3 (0.5.3-0.6.6 family), torch backend, cpu, float32"
    assert lines[1].startswith("PASS v1: vLLM called paged_attention_v1 (expected paged_attention_v1); max error ")
    assert lines[2].startswith("PASS v2: vLLM called paged_attention_v2 (expected paged_attention_v2); max error ")
    assert lines[-1] == "verify: PASS"
