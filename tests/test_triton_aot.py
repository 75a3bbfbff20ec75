"""Ahead-of-time compile of the Triton kernel variants for a BI-V100 (capability 7.0, 48 KB), no GPU.

One session-wide compile (parallel processes) feeds the tests here. It compiles a covering subset of the
variant list (``covering_subset``: every compiled class at its smallest and its largest head), 143 of its 280
distinct kernels, and stops at LLVM IR, where shared memory is known (``through="llir"``: LLVM's O3 for
NVPTX, PTX and cubin are NVIDIA's steps, not CoreX's); one test checks that the whole pipeline reports the
same figure. On a 2-core machine that takes about 90 s; the whole list through the whole pipeline took 16
minutes. ``BIV100_AOT_ALL=1`` compiles the whole list.
"""

import os
import time

import pytest

from kernels import configs, contract, variants
from tests.conftest import REPO_ROOT

CAPABILITY = (7, 0)
SHARED_MEMORY_LIMIT = 48 * 1024
LISTED = variants.variant_list(variants.target_limits(CAPABILITY, SHARED_MEMORY_LIMIT))


def covering_subset(listed):
    """The variants of ``listed`` whose padded head is the smallest or the largest of their class (attention:
    config, dtype and cache format; reduce: dtype and scratch dtype; partition: dtype). The largest head needs
    the most shared memory; the smallest gives tl.dot its narrowest tiles."""
    def compiled_class(variant):
        if variant.kernel == "attention":
            return variant.kernel, variant.config, variant.dtype, variant.kv_cache_dtype
        return variant.kernel, variant.dtype, variant.config[-1] if variant.kernel == "reduce" else None

    heads = {}
    for variant in listed:
        heads.setdefault(compiled_class(variant), set()).add(configs._next_power_of_2(variant.head_size))
    return [variant for variant in listed
            if configs._next_power_of_2(variant.head_size) in (min(heads[compiled_class(variant)]),
                                                               max(heads[compiled_class(variant)]))]


@pytest.fixture(scope="session")
def compiled():
    chosen = LISTED if os.environ.get("BIV100_AOT_ALL") == "1" else covering_subset(LISTED)
    started = time.perf_counter()
    # Stopped at LLVM IR, a compile leaves no finished kernel in Triton's cache: each run compiles anew.
    results = variants.compile_variants(CAPABILITY, SHARED_MEMORY_LIMIT, variants=chosen, through="llir")
    seconds = time.perf_counter() - started
    distinct = {variant.compile_key() for variant in chosen}
    print(f"\nAOT capability {CAPABILITY}: {len(results)} variants ({len(distinct)} compiled) in {seconds:.1f} s, "
          f"max shared {max(r['shared_bytes'] or 0 for r in results)} bytes")
    return results


def test_every_variant_compiles_within_48kb(compiled):
    failed = [r for r in compiled if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} d{r['head_size']} b{r['block_size']} {r['dtype']} "
                                 f"{r['kv_cache_dtype']} {r['config']}: {r['error']}" for r in failed[:20])
    assert all(0 <= r["shared_bytes"] <= SHARED_MEMORY_LIMIT for r in compiled)
    assert all(r["shared_bytes"] > 0 for r in compiled if r["kernel"] == "attention")  # real numbers came back


def test_the_subset_reaches_every_attention_config_and_both_ends_of_the_heads():
    subset = covering_subset(LISTED)
    assert len({variant.compile_key() for variant in subset}) == 143
    attention = lambda chosen: {(v.config, v.dtype, v.kv_cache_dtype) for v in chosen  # noqa: E731
                                if v.kernel == "attention"}
    assert attention(subset) == attention(LISTED)
    for kernel in ("reduce", "partition"):
        for head_size in (32, 256):
            whole = {(v.config, v.dtype) for v in LISTED if v.kernel == kernel and v.head_size == head_size}
            assert whole <= {(v.config, v.dtype) for v in subset if v.kernel == kernel}


def test_the_fused_combine_is_compiled_for_the_targets_warp():
    # The combine tile depends on the threads of a warp: a BI-V100's 64 hold twice the splits of 32.
    from kernels import paged_attention_triton

    attention = [v for v in LISTED if v.kernel == "attention"]
    differs = 0
    for variant in attention:
        tiles = [variants._attention_source(paged_attention_triton, variant, warp)[1]["COMBINE_SPLITS"]
                 for warp in (32, 64)]
        assert tiles == [configs.combine_tile(variant.config, variant.config.heads_block, variant.head_size, warp)[1]
                         for warp in (32, 64)], variant
        differs += tiles[0] != tiles[1]
    assert differs > 0


def test_variants_cover_the_whole_contract():
    attention = {(v.head_size, v.block_size, v.dtype, v.kv_cache_dtype) for v in LISTED if v.kernel == "attention"}
    assert attention == {(h, b, d, f) for h in contract.HEAD_SIZES for b in contract.BLOCK_SIZES
                         for d in ("float32", "float16", "bfloat16") for f in variants.CACHE_FORMATS}
    reduce = {(v.head_size, v.dtype) for v in LISTED if v.kernel == "reduce"}
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


def test_stopping_at_llvm_ir_reports_the_shared_memory_of_the_whole_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # an empty cache: the LLVM IR run really compiles
    variant = next(v for v in LISTED
                   if v.kernel == "attention" and v.config.use_dot and v.kv_cache_dtype == "fp8_e4m3")
    at_llir, whole = (variants.compile_variants(CAPABILITY, SHARED_MEMORY_LIMIT, variants=[variant], workers=1,
                                                through=through)[0] for through in ("llir", "cubin"))
    assert whole["ok"] and at_llir["ok"]
    assert at_llir["shared_bytes"] == whole["shared_bytes"] > 0


def test_an_unknown_stage_is_refused_before_any_compile():
    with pytest.raises(ValueError, match="through must be one of cubin, llir; got 'ptx'"):
        variants.compile_variants(CAPABILITY, SHARED_MEMORY_LIMIT, variants=LISTED[:1], through="ptx")


def test_a_limit_below_the_need_is_reported_per_variant():
    one = [v for v in LISTED if v.kernel == "attention" and v.config.use_dot][:1]
    (result,) = variants.compile_variants(CAPABILITY, 1024, variants=one, workers=1)
    assert not result["ok"] and "over the limit of 1024" in result["error"] and result["shared_bytes"] > 1024


_PTX_LOADS = r"""
import collections, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import configs, paged_attention_triton, variants

use_dot, prefetch, stages, warps = json.loads(sys.argv[1])
config = configs.KernelConfig(16, 16 if use_dot else 1, warps, stages, use_dot, prefetch)
variant = variants.Variant("attention", 128, 16, "float16", "auto", config)
fn, constants, options = variants._attention_source(paged_attention_triton, variant, 32)
signature, constexprs, attrs = variants._signature(fn, variant, constants)
# What a launch on vLLM's tensors specialises: strides that are multiples of 16 (not K's slot stride, x = 8).
for i, name in enumerate(fn.arg_names):
    if signature[name] == "i32" and name in ("stride_o0", "stride_o1", "stride_q0", "stride_q1", "stride_k0",
                                             "stride_k1", "stride_k2", "stride_v0", "stride_v1", "stride_v2"):
        attrs[(i,)] = [["tt.divisibility", 16]]
compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)
loads = collections.Counter(re.findall(r"ld\.global[\w.]*", compiled.asm["ptx"]))
# The pipeliner's K/V buffers ([stages, ...] shared allocations) and how many copies a wait may leave in flight.
ttgir = compiled.asm["ttgir"]
loads["buffers"] = max([int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)] or [0])
loads["in_flight"] = max([int(n) for n in re.findall(r"async_wait .*num = (\d+)", ttgir)] or [0])
# The tiles the async copies read: [rows, contiguous elements] where K loads in memory order.
loads["copied_tiles"] = sorted(set(re.findall(r"async_copy_global_to_local .*: tensor<(\d+x\d+)x!tt\.ptr", ttgir)))
print(json.dumps(loads))
"""


def _compile_for_h100_class(use_dot, prefetch, stages, warps):
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PTX_LOADS, json.dumps([use_dot, prefetch, stages, warps])],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("use_dot,prefetch,stages,warps", [(True, True, 1, 1), (False, True, 1, 2),
                                                          (True, False, 3, 1), (False, False, 3, 2)])
def test_cache_loads_are_16_byte_vectors(use_dot, prefetch, stages, warps):
    """K and V come in 16-byte loads on vLLM's layout: the speed rests on it (per-element 2-byte loads held
    every H200 row at 33-41% of copy). Compiled for capability 9.0 without a GPU, the PTX is read."""
    loads = _compile_for_h100_class(use_dot, prefetch, stages, warps)
    assert "ld.global.b16" not in loads and "ld.global.u16" not in loads, loads
    if prefetch:  # (pipelined tl.dot variants load through cp.async instead)
        assert loads.get("ld.global.v4.b32", 0) >= 8, loads


def test_pipelined_dot_steps_keep_loads_in_flight():
    """With 3 stages Triton's pipeliner double-buffers the K and V of tl.dot and lets the next step's copies
    run while a step computes. A block id loaded in the same step as its K/V left it one buffer and a wait
    for every copy (66% of copy on the H200 instead of 80%)."""
    loads = _compile_for_h100_class(True, False, 3, 1)
    assert loads["buffers"] >= 2 and loads["in_flight"] >= 1, loads


def test_pipelined_key_copies_read_whole_rows():
    """K's async copies read [head_size / x, block_size * x] tiles, rows contiguous in vLLM's layout, as V's
    read [block_size, head_size]: loaded as [head_size, block_size], 8 lanes of a copy spanned 8 rows 256
    bytes apart, and the H200 moved twice the L2 sectors (80% of copy instead of 98-103%)."""
    assert _compile_for_h100_class(True, False, 3, 1)["copied_tiles"] == ["16x128"]
