"""Signature families: version rules, and the real vLLM wheels' _custom_ops.py patched and called."""

import math

import pytest
import torch
from packaging.version import Version

from biv100_patch.patches import families
from tests import fake_vllm
from tests.fake_vllm import family_arguments, fresh_patcher, v2_buffers  # noqa: F401 (fixture)
from tests.reference import reference_attention
from tests.vllm_patch_check import make_case


@pytest.mark.parametrize("raw, family", [
    ("0.4.2", "0.4.2"), ("0.4.3", "0.4.3-0.5.2"), ("0.5.2", "0.4.3-0.5.2"), ("0.5.3.post1", "0.5.3-0.6.6"),
    ("0.6.3+corex.3.2.3", "0.5.3-0.6.6"), ("0.6.6.post1", "0.5.3-0.6.6"), ("0.7.0", "0.7.0-0.24.x"),
    ("0.10.1.1", "0.7.0-0.24.x"), ("0.11.2+corex.4.4.0", "0.7.0-0.24.x"), ("0.24.9", "0.7.0-0.24.x"),
    ("0.4.1", None), ("0.25.0", None), ("0.27.0", None), ("dev", None), (None, None),
])
def test_version_verdict(raw, family):
    found, version, reason = families.version_verdict(raw)
    assert (found.name if found else None) == family
    if raw is None:
        assert reason == "vLLM is not installed"
    elif raw == "dev":
        assert version is None and "cannot be parsed" in reason
    elif family is None:
        assert "removed in 0.25" in reason if version >= Version("0.25") else "older than 0.4.2" in reason


def test_base_version_drops_local_and_post():
    assert families.base_version("0.6.3+corex.3.2.3") == Version("0.6.3")
    assert families.base_version("0.6.3.post1") == Version("0.6.3")


def test_schemas_are_vllms():
    family = families.FAMILIES[2]
    assert family.schema("paged_attention_v2") == (
        "paged_attention_v2(Tensor! out, Tensor! exp_sums, Tensor! max_logits, Tensor! tmp_out, Tensor query, "
        "Tensor key_cache, Tensor value_cache, int num_kv_heads, float scale, Tensor block_tables, "
        "Tensor seq_lens, int block_size, int max_seq_len, Tensor? alibi_slopes, str kv_cache_dtype, "
        "float k_scale, float v_scale, int tp_rank, int blocksparse_local_blocks, int blocksparse_vert_stride, "
        "int blocksparse_block_size, int blocksparse_head_sliding_step) -> ()")
    assert "Tensor k_scale, Tensor v_scale" in families.FAMILIES[3].schema("paged_attention_v1")
    assert "float kv_scale, int tp_rank" in families.FAMILIES[1].schema("paged_attention_v1")


@pytest.fixture(scope="session")
def wheel_sources():
    return fake_vllm.fetch_all(fake_vllm.FAMILY_WHEELS)


@pytest.mark.parametrize("version", list(fake_vllm.FAMILY_WHEELS))
def test_real_wheel_custom_ops(version, wheel_sources, fresh_patcher, tmp_path, caplog):  # noqa: F811
    """Each family's real _custom_ops.py: classified, patched, called as vLLM calls it, reverted."""
    family, wrapped = fake_vllm.FAMILY_WHEELS[version]
    site = fake_vllm.make_site(tmp_path / "site", version, wheel_sources[version])
    source = (site / "vllm" / "_custom_ops.py").read_text()
    if "impl_abstract" in source and not hasattr(torch.library, "impl_abstract"):
        pytest.skip(f"vLLM {version}'s _custom_ops imports torch.library.impl_abstract (torch 2.2+): "
                    f"torch {torch.__version__} cannot import it")
    with fake_vllm.imported(site) as module:
        originals = {name: getattr(module, name, None) for name in families.OP_NAMES}
        match = families.classify(version, module)
        assert (match.family.name if match.family else None) == family
        assert match.wrapped == wrapped
        caplog.set_level("INFO", logger="biv100_patch")
        decision = fresh_patcher.apply("torch")
        state = fresh_patcher.state()
        if family is None:
            assert decision["backend"] == "off" and state["status"] == "skipped"
            assert "removed in 0.25" in state["reason"]
            assert {name: getattr(module, name, None) for name in originals} == originals
            assert [r.levelname for r in caplog.records] == ["WARNING"]
            return
        assert state["status"] == "patched" and state["family"] == family and state["hint_on_error"] == wrapped
        assert [r.getMessage() for r in caplog.records if r.levelname == "INFO"][0].startswith(
            f"biv100-patch: patched vLLM {version} ({family} family")

        # v1 and v2 exactly as the version's PagedAttention.forward_decode passes them.
        case = make_case(torch, torch.float32, [600, 1300, 7], num_heads=4, num_kv_heads=1, head_size=128)
        expected = reference_attention(**case)
        out = torch.full_like(case["query"], math.nan)
        module.paged_attention_v1(*family_arguments(family, "paged_attention_v1", case, out))
        assert (out.double() - expected["out"]).abs().max().item() < 1e-4
        out = torch.full_like(case["query"], math.nan)
        buffers = v2_buffers(case)
        module.paged_attention_v2(*family_arguments(family, "paged_attention_v2", case, out, buffers))
        assert (out.double() - expected["out"]).abs().max().item() < 1e-4
        written = expected["written"]
        assert (buffers[1].double() - expected["max_logits"])[written].abs().max().item() < 1e-4
        assert torch.isnan(buffers[0][~written]).all()

        # The dispatcher entry (0.5+ call torch.ops._C; this process has no vllm._C, so we defined it).
        if Version(version) >= Version("0.5.0"):
            assert state["dispatcher"] == {"dispatch_key": "CPU", "defined": list(families.OP_NAMES),
                                           "replaced": []}
            out = torch.full_like(case["query"], math.nan)
            torch.ops._C.paged_attention_v2(*family_arguments(family, "paged_attention_v2", case, out,
                                                              v2_buffers(case)))
            assert (out.double() - expected["out"]).abs().max().item() < 1e-4
        else:
            assert "pybind" in state["dispatcher"]["skipped"]
            assert not hasattr(torch.ops._C, "paged_attention_v2")

        assert fresh_patcher.revert() is True
        assert all(getattr(module, name) is originals[name] for name in families.OP_NAMES)
        assert not hasattr(torch.ops._C, "paged_attention_v1")
        assert not hasattr(torch.ops._C, "paged_attention_v2")
