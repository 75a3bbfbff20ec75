"""apply()/revert()/state(): idempotent, thread-safe, switchable off, cheap to import; plugin and CLI."""

import json
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from biv100_patch import patches
from tests import fake_vllm
from tests.fake_vllm import fresh_patcher  # noqa: F401 (fixture)


@pytest.fixture
def site(tmp_path):
    return fake_vllm.make_site(tmp_path / "site", "0.6.3+corex.3.2.3", fake_vllm.synthetic_custom_ops())


def test_import_is_cheap():
    script = ("import sys, biv100_patch.patches\n"
              "print(sorted(n for n in ('torch', 'triton', 'vllm', 'packaging', 'click') if n in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_apply_is_idempotent_and_revert_exact(fresh_patcher, site):  # noqa: F811
    with fake_vllm.imported(site) as module:
        originals = (module.paged_attention_v1, module.paged_attention_v2)
        first = patches.apply("torch")
        patched = (module.paged_attention_v1, module.paged_attention_v2)
        assert patches.apply("torch") == first and patches.apply() == first
        assert (module.paged_attention_v1, module.paged_attention_v2) == patched
        assert patches.state()["status"] == "patched" and patches.state()["family"] == "0.5.3-0.6.6"
        assert patches.revert() is True and patches.revert() is False
        assert (module.paged_attention_v1, module.paged_attention_v2) == originals
        assert module.paged_attention_v1.__wrapped__.__name__ == "paged_attention_v1"  # hint_on_error kept


def test_apply_with_another_backend_repatches(fresh_patcher, site):  # noqa: F811
    with fake_vllm.imported(site) as module:
        originals = (module.paged_attention_v1, module.paged_attention_v2)
        patches.apply("torch")
        patches.apply("triton")
        assert module.paged_attention_v1.biv100_patch.name == "triton"
        patches.revert()
        assert (module.paged_attention_v1, module.paged_attention_v2) == originals


def test_concurrent_apply_patches_once(fresh_patcher, site):  # noqa: F811
    with fake_vllm.imported(site) as module:
        barrier, results = threading.Barrier(8), []

        def worker():
            barrier.wait()
            results.append(patches.apply("torch")["backend"])
            results.append(module.paged_attention_v1.biv100_patch)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert results.count("torch") == 8
        assert len({id(ops) for ops in results if ops != "torch"}) == 1  # one patch, shared by all


@pytest.mark.parametrize("variable, value", [("BIV100_PATCH", "0"), ("BIV100_PATCH_BACKEND", "off")])
def test_off_switch(fresh_patcher, site, monkeypatch, variable, value):  # noqa: F811
    monkeypatch.setenv(variable, value)
    with fake_vllm.imported(site) as module:
        original = module.paged_attention_v1
        decision = patches.apply()
        assert decision["backend"] == "off" and variable in decision["reason"]
        assert module.paged_attention_v1 is original and patches.state()["status"] == "skipped"


def test_bad_setting_is_reported_not_raised(fresh_patcher, site, monkeypatch):  # noqa: F811
    monkeypatch.setenv("BIV100_PATCH", "maybe")
    with fake_vllm.imported(site):
        decision = patches.apply()
        assert decision["source"] == "error" and "BIV100_PATCH='maybe' is not allowed" in decision["reason"]
        assert patches.state()["status"] == "failed"


def test_bad_backend_argument_raises(fresh_patcher):  # noqa: F811
    with pytest.raises(ValueError, match="backend: must be one of auto, triton, torch, off; got 'cuda'"):
        patches.apply("cuda")


def test_auto_uses_the_probe_decision_and_survives_a_failing_probe(fresh_patcher, site, monkeypatch):  # noqa: F811
    from biv100_patch import probe
    monkeypatch.setattr(probe, "get_decision", lambda **_: {"decision": {"backend": "torch", "reason": "measured"}})
    with fake_vllm.imported(site) as module:
        assert patches.apply()["reason"] == "measured"
        patches.revert()

        def broken(**_):
            raise OSError("disk on fire")
        monkeypatch.setattr(probe, "get_decision", broken)
        decision = patches.apply()
        assert decision["backend"] == "torch" and "the probe failed (OSError: disk on fire)" in decision["reason"]
        assert module.paged_attention_v1.biv100_patch.name == "torch"


def test_validate_setting_checks_tables(fresh_patcher, site, monkeypatch):  # noqa: F811
    monkeypatch.setenv("BIV100_PATCH_VALIDATE", "1")
    with fake_vllm.imported(site) as module:
        patches.apply("torch")
        assert module.paged_attention_v1.biv100_patch.validate_tables is True


def test_plugin_register_never_raises(fresh_patcher, monkeypatch):  # noqa: F811
    from biv100_patch.patches import plugin

    def exploding(backend="auto"):
        raise RuntimeError("boom")
    monkeypatch.setattr(patches, "apply", exploding)
    plugin.register()  # logs, does not raise


def test_status_and_verify_commands_without_vllm(tmp_path, monkeypatch):
    from biv100_patch.cli import main
    monkeypatch.setenv("BIV100_PATCH_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["status", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["vllm"] == {"vllm_version": None, "family": None, "reason": "vLLM is not installed", "note": None}
    assert "installed" in report["hook"]
    result = CliRunner().invoke(main, ["verify"])
    assert result.exit_code == 1 and "FAIL: vLLM's PagedAttention cannot be imported" in result.output
