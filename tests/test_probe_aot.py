"""``biv100-patch probe --target-capability 7.0`` with the real ahead-of-time compiler (no GPU).

Real AOT of two variants (the first attention and the first reduce kernel of the kernels' own
list), so the test stays short; the full list is what the command compiles without the patch.
"""

import json

from biv100_patch.kernels import variants
from biv100_patch.probe_command import probe_command

from tests.conftest import cli_runner
from tests.probe_fixtures import state  # noqa: F401 (fixture)


def test_target_capability_7_0_report_from_real_compiles(state, monkeypatch):
    full_list = variants.variant_list

    def two_variants(limits):
        listed = full_list(limits)
        return [next(v for v in listed if v.kernel == "attention"), next(v for v in listed if v.kernel == "reduce")]

    monkeypatch.setattr(variants, "variant_list", two_variants)
    result = cli_runner().invoke(probe_command, ["--target-capability", "7.0", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["target"] == {"capability": "7.0", "shared_memory_limit": 49152}
    assert document["summary"] == {"variants": 2, "ok": 2, "failed": 0}
    attention, reduce = document["aot"]
    assert (attention["kernel"], reduce["kernel"]) == ("attention", "reduce")
    for entry in document["aot"]:
        assert entry["ok"] is True and entry["error"] is None
        assert isinstance(entry["shared_bytes"], int) and 0 <= entry["shared_bytes"] <= 49152
        assert {"head_size", "block_size", "dtype", "kv_cache_dtype", "config"} <= set(entry)
    assert "aot: compiled 2/2" in result.stderr


def test_a_limit_no_config_fits_fails_the_report(state):
    result = cli_runner().invoke(probe_command, ["--target-capability", "7.0", "--shared-memory-limit", "1024"])
    assert result.exit_code == 1, result.output
    assert "AOT for capability 7.0: shared_memory_per_block: no Triton config" in result.stderr
