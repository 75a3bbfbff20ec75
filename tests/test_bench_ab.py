"""The A/B harnesses (``benchmarks/ab_torch_backend.py``, ``ab_triton_backend.py``) and the sub-split sweep
(``sweep_v2_subsplits.py``) on the CPU: their argument errors, the baseline loader, the sweep's forced count, and the
contiguous K/V that the Triton A/B times SDPA on (no timing: they need a GPU)."""

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


@pytest.fixture(scope="module")
def harnesses():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ab_torch_backend
        import ab_triton_backend
    finally:
        sys.path.remove(str(BENCHMARKS))
    return ab_torch_backend, ab_triton_backend


@pytest.mark.parametrize("script", ["ab_torch_backend.py", "ab_triton_backend.py"])
def test_bad_arguments_name_the_argument(script, tmp_path):
    run = [sys.executable, str(BENCHMARKS / script), "--baseline", str(tmp_path)]
    result = subprocess.run(run + ["--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--rounds: must be at least 1; got 0" in result.stderr
    result = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "holds no kernels/__init__.py" in result.stderr


def test_sub_split_sweep_checks_its_arguments_and_needs_a_gpu(tmp_path):
    run = [sys.executable, str(BENCHMARKS / "sweep_v2_subsplits.py"), "--results-dir", str(tmp_path)]
    result = subprocess.run(run + ["--rep-ms", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--rep-ms: must be positive; got 0.0" in result.stderr
    result = subprocess.run(run + ["--dtype", "fp8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "argument --dtype: invalid choice: 'fp8'" in result.stderr
    if not torch.cuda.is_available():
        result = subprocess.run(run, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and "it needs a CUDA device" in result.stderr
        assert not list(tmp_path.iterdir())


def test_sub_split_sweep_forces_the_count_only_while_set():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import sweep_v2_subsplits
    finally:
        sys.path.remove(str(BENCHMARKS))
    choose, forced = sweep_v2_subsplits.forced_subsplits(lambda *args: 8)
    assert choose(None, 8, 4, 512, 16) == 8
    forced["subs"] = 2
    assert choose(None, 8, 4, 512, 16) == 2
    forced["subs"] = None
    assert choose(None, 8, 4, 512, 16) == 8


def test_rounds_alternate_the_order_and_drop_the_warm_up():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCHMARKS))
    seen = []
    samples = _common.interleaved_samples({"a": "A", "b": "B"}, lambda fn: seen.append(fn) or len(seen), 2,
                                          warmup_rounds=2)
    assert seen == ["B", "A", "A", "B", "B", "A", "A", "B"]
    assert samples == {"a": [6, 7], "b": [5, 8]}


def test_entry_points_are_checked(harnesses, tmp_path):
    _, ab_triton_backend = harnesses
    assert {row[4] for row in ab_triton_backend.ROWS} == set(ab_triton_backend.ENTRY_POINTS)
    run = [sys.executable, str(BENCHMARKS / "ab_triton_backend.py"), "--baseline", str(tmp_path), "--entry", "v3"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "argument --entry: invalid choice: 'v3'" in result.stderr


def test_baseline_loads_as_its_own_package(harnesses, tmp_path):
    ab_torch_backend, _ = harnesses
    subprocess.run(f"git -C {REPO_ROOT} archive HEAD kernels | tar -x -C {tmp_path}", shell=True, check=True)
    module = ab_torch_backend.load_baseline(str(tmp_path), "paged_attention_triton")
    assert module.__name__ == "baseline_kernels.paged_attention_triton"
    assert module.__file__ == str(tmp_path / "kernels" / "paged_attention_triton.py")
    assert callable(module.make_forward)


@pytest.mark.parametrize("heads,seqs,tokens", [((8, 2), 2, 64), ((4, 4), 3, 48)])
def test_sdpa_reads_each_sequences_blocks(harnesses, heads, seqs, tokens):
    ab_torch_backend, ab_triton_backend = harnesses
    from kernels import paged_attention_torch

    call, kv_bytes = ab_torch_backend.make_call(torch.float32, heads, seqs, tokens, "v1", torch.device("cpu"))
    assert kv_bytes == 2 * seqs * tokens * heads[1] * ab_torch_backend.HEAD_SIZE * 4
    paged_attention_torch.forward(call)
    sdpa = ab_triton_backend.contiguous_sdpa(call)().reshape(call.out.shape)
    torch.testing.assert_close(sdpa, call.out, atol=1e-5, rtol=1e-5)
    call.block_tables.copy_(call.block_tables.roll(1, dims=0))  # other sequences' blocks: another answer
    assert not torch.allclose(ab_triton_backend.contiguous_sdpa(call)().reshape(call.out.shape), call.out,
                              atol=1e-3)
