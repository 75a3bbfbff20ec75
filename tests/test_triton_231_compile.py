"""The kernels a BI-V100 runs, compiled by Triton 2.3.1 itself (the BI-V100's version), no GPU.

The 2.3 subset check (test_triton_23_subset.py) only checks names; 2.3.1's compiler also has its own typing
(a scalar beside a bfloat16 tensor made float32, and tl.dot then refused the pair: found on the H200, see
results/nvidia-h200/triton231.json). Here every variant the BI-V100's figures pick (capability 7.0, 48 KB,
warp 64), for head sizes that pad to 128 and 256 and 16-token blocks (plus every reduce and partition-reduce
variant), goes through 2.3.1's pipeline down to LLVM IR, where its shared memory is known (PTX and cubin
are NVIDIA's stages; a BI-V100 compiles LLVM IR through CoreX's backend). It compiles for capability 8.0:
2.3.1's own 7.0 backend is NVIDIA Volta's, which rejects bfloat16 in ptxas and fails every 16-bit tl.dot
("map::at"). The 2.3.1 installed by .ci/run under .ci/envs/triton231 runs in a child process, with the
compiles in spawned workers under it (Triton's cache in .ci/envs).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TRITON_231 = REPO_ROOT / ".ci" / "envs" / "triton231"


def under_triton_231(code):
    """Run ``code`` in a child whose ``triton`` is 2.3.1; return the JSON of its last output line."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRITON_231), str(REPO_ROOT)]),
                       TRITON_CACHE_DIR=str(REPO_ROOT / ".ci" / "envs" / "triton231-cache"))
    environment.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=environment, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

COMPILE = """
import json
from kernels import configs, variants

if __name__ == "__main__":
    bi_v100 = variants.target_limits((7, 0), 48 * 1024, warp_size=64)
    chosen = [variant for variant in variants.variant_list(bi_v100)
              if (variant.kernel != "attention" or variant.block_size == 16)
              and configs._next_power_of_2(variant.head_size) in (128, 256)]
    results = variants.compile_variants((8, 0), 48 * 1024, variants=chosen, workers=2, through="llir")
    import triton
    print(json.dumps({"triton": triton.__version__, "results": results}))
"""


@pytest.mark.skipif(not (TRITON_231 / "triton").is_dir(), reason="needs .ci/envs/triton231 (.ci/run installs it)")
def test_bi_v100_variants_compile_under_triton_2_3_1():
    found = under_triton_231(COMPILE)
    assert found["triton"] == "2.3.1"
    results = found["results"]
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['kernel']} d{r['head_size']} b{r['block_size']} {r['dtype']} "
                                 f"{r['kv_cache_dtype']} {r['config']}: {r['error'][:300]}" for r in failed[:10])
    kinds = {(r["kernel"], r["dtype"], r["kv_cache_dtype"]) for r in results}
    assert len(kinds) == 3 * 3 + 3 * 2  # attention per dtype and cache format; reduce and partition per dtype
    assert all(r["shared_bytes"] > 0 for r in results if r["kernel"] == "attention")  # real compiler output


CRASH = """
import json
from kernels import variants

if __name__ == "__main__":
    bi_v100 = variants.target_limits((7, 0), 48 * 1024, warp_size=64)
    picked = [variant for variant in variants.variant_list(bi_v100)
              if variant.kernel == "attention" and variant.dtype == "float16" and variant.kv_cache_dtype == "auto"
              and variant.block_size == 32 and variant.head_size in (32, 64)]
    print(json.dumps(variants.compile_variants((7, 0), 48 * 1024, variants=picked, workers=2)))
"""


@pytest.mark.skipif(not (TRITON_231 / "triton").is_dir(), reason="needs .ci/envs/triton231 (.ci/run installs it)")
def test_a_compiler_crash_fails_its_variant_not_the_run():
    """Triton 2.3.1's Volta backend aborts the process on the 16-bit tl.dot kernel at head 32, block 32 (an
    assertion in ReduceOpToLLVM): that variant fails with the crash named, the others still get their result."""
    outcome = {(r["head_size"], r["config"]["use_dot"]): r["error"] for r in under_triton_231(CRASH)}
    assert outcome[(32, True)] == "the compiler crashed (its process died)"
    assert outcome[(32, False)] is None and outcome[(64, False)] is None  # one-row broadcast products compile
    assert outcome[(64, True)].startswith("IndexError: map::at")  # 2.3.1's Volta MMA path, reported, no crash
