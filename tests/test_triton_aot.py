"""Ahead-of-time compile of every Triton kernel variant for a BI-V100 (capability 7.0, 48 KB), no GPU.

One session-wide compile (parallel processes, Triton's cache) feeds every test here.
"""

import os
import time

import pytest

from kernels import configs, contract, variants
from tests.conftest import REPO_ROOT

CAPABILITY = (7, 0)
SHARED_MEMORY_LIMIT = 48 * 1024


@pytest.fixture(scope="session")
def compiled():
    # CI keeps .ci/envs between runs: Triton's cache there makes a rerun take seconds (a first run: minutes).
    cache = REPO_ROOT / ".ci" / "envs" / "triton-cache"
    previous = os.environ.get("TRITON_CACHE_DIR")
    if previous is None and cache.parent.is_dir():
        os.environ["TRITON_CACHE_DIR"] = str(cache)
    started = time.perf_counter()
    try:
        results = variants.compile_variants(CAPABILITY, SHARED_MEMORY_LIMIT)
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
    seconds = time.perf_counter() - started
    distinct = {(r["kernel"], configs._next_power_of_2(r["head_size"]), r["block_size"], r["dtype"],
                 r["kv_cache_dtype"], str(r["config"])) for r in results}
    print(f"\nAOT capability {CAPABILITY}: {len(results)} variants ({len(distinct)} compiled) in {seconds:.1f} s, "
          f"max shared {max(r['shared_bytes'] or 0 for r in results)} bytes")
    return results


def test_every_variant_compiles_within_48kb(compiled):
    failed = [r for r in compiled if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} d{r['head_size']} b{r['block_size']} {r['dtype']} "
                                 f"{r['kv_cache_dtype']} {r['config']}: {r['error']}" for r in failed[:20])
    assert all(0 <= r["shared_bytes"] <= SHARED_MEMORY_LIMIT for r in compiled)
    assert all(r["shared_bytes"] > 0 for r in compiled if r["kernel"] == "attention")  # real numbers came back


def test_variants_cover_the_whole_contract(compiled):
    attention = {(r["head_size"], r["block_size"], r["dtype"], r["kv_cache_dtype"])
                 for r in compiled if r["kernel"] == "attention"}
    assert attention == {(h, b, d, f) for h in contract.HEAD_SIZES for b in contract.BLOCK_SIZES
                         for d in ("float32", "float16", "bfloat16") for f in variants.CACHE_FORMATS}
    reduce = {(r["head_size"], r["dtype"]) for r in compiled if r["kernel"] == "reduce"}
    assert reduce == {(h, d) for h in contract.HEAD_SIZES for d in ("float32", "float16", "bfloat16")}


def test_estimate_bounds_the_compiled_shared_memory(compiled):
    """The config choice trusts configs.estimate_shared_bytes: it must not undercount the compiler."""
    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    for r in compiled:
        if r["kernel"] == "attention":
            c = r["config"]
            estimate = configs.estimate_shared_bytes(CAPABILITY, r["head_size"], c["block_n"], c["heads_block"],
                                                     dtypes[r["dtype"]], r["kv_cache_dtype"], c["num_stages"],
                                                     c["use_dot"])
            assert r["shared_bytes"] <= estimate, r


def test_a_limit_below_the_need_is_reported_per_variant():
    limits = variants.target_limits(CAPABILITY, SHARED_MEMORY_LIMIT)
    one = [v for v in variants.variant_list(limits) if v.kernel == "attention" and v.config.use_dot][:1]
    (result,) = variants.compile_variants(CAPABILITY, 1024, variants=one, workers=1)
    assert not result["ok"] and "over the limit of 1024" in result["error"] and result["shared_bytes"] > 1024
