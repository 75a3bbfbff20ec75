"""The paged-attention benchmark runs end to end on the CPU (tiny grid) and writes real numbers.

One run of a 2-row grid (a v1 row and a v2 row) into a temporary results directory is shared by the tests; the rest is the
grid plan, vLLM's v1/v2 rule and the wrong-backend flagging, checked in-process (no timing).
"""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "bench_paged_attention.py"
TINY_GRID = ["--device", "cpu", "--dtypes", "fp16", "--heads", "4x2", "--num-seqs", "2", "--seq-lens", "32,600",
             "--rep-ms", "5", "--launch-calls", "2", "--copy-gib", "0.015625", "--tag", "smoke"]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_paged_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


@pytest.fixture(scope="module")
def cpu_run(bench, tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    assert bench.main(TINY_GRID + ["--results-dir", str(root)]) == 0
    directory = root / "cpu"
    return {suffix: directory / f"paged_attention-smoke.{suffix}" for suffix in ("json", "md", "png")}


def _torch_backend_importable():
    return (REPO_ROOT / "kernels" / "paged_attention_torch.py").exists()


def test_help_runs_as_a_script():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--dtypes", "--heads", "--num-seqs", "--seq-lens", "--quick", "--shared-memory-limit",
                   "--budget-seconds", "--device"):
        assert option in result.stdout


def test_json_holds_measured_numbers(cpu_run):
    payload = json.loads(cpu_run["json"].read_text())
    assert payload["complete"] is True
    assert payload["environment"]["torch"] == torch.__version__
    assert payload["environment"]["gpu"] == "cpu"
    assert math.isfinite(payload["copy_gbps"]) and payload["copy_gbps"] > 0
    assert [(row["num_seqs"], row["seq_len"]) for row in payload["rows"]] == [(2, 32), (2, 600)]
    assert any("Triton backend skipped on the CPU" in note for note in payload["notes"])
    for row in payload["rows"]:
        assert row["kv_bytes"] == 2 * row["num_seqs"] * row["seq_len"] * 2 * 128 * 2
        assert row["vllm_entry"] == ("v1" if row["seq_len"] <= 512 else "v2")
        sdpa = row["results"]["sdpa"]
        assert sdpa["ok"], sdpa
        assert sdpa["rel_err_vs_fp32"] < 5e-3
        assert sdpa["us"] > 0 and sdpa["gbps"] > 0
        assert sdpa["pct_copy"] == pytest.approx(100 * sdpa["gbps"] / payload["copy_gbps"])


def test_torch_backend_row_results(cpu_run):
    payload = json.loads(cpu_run["json"].read_text())
    launch = payload["launch_overhead_us"]["torch"]
    assert payload["host_reference_us"]["torch_add"]["us"] > 0
    for row in payload["rows"]:
        result = row["results"]["torch"]
        if not _torch_backend_importable():
            assert "paged_attention_torch" in result["failed"]
            continue
        assert result["ok"], result
        assert result["entry"] == row["vllm_entry"]
        assert result["rel_err_vs_sdpa"] < 5e-3 and result["max_abs_err_vs_sdpa"] < 1e-2
        assert result["us"] > 0 and math.isfinite(result["pct_copy"])
    if _torch_backend_importable():
        assert launch["us"] > 0


def test_markdown_and_plot_written(cpu_run):
    text = cpu_run["md"].read_text()
    assert "| fp16 | 4/2 | 2 x 600 |" in text
    assert "Copy ceiling" in text and "launch overhead" in text
    png = cpu_run["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_full_grid_plan(bench):
    args = bench.parse_args(["--device", "cpu"])
    rows, skipped = bench.plan_rows(args, torch.device("cpu"))
    assert len(rows) + len(skipped) == 2 * 3 * 6 * 4
    # Only (32, 32) heads at 128 and 256 x 32768 tokens exceed 40 GB of K+V, in both dtypes.
    assert sorted((r["dtype"], r["num_kv_heads"], r["num_seqs"], r["seq_len"]) for r in skipped) == [
        ("bf16", 32, 128, 32768), ("bf16", 32, 256, 32768), ("fp16", 32, 128, 32768), ("fp16", 32, 256, 32768)]
    assert max(row["kv_bytes"] for row in rows) == 256 * 32768 * 8 * 128 * 2 * 2


@pytest.mark.parametrize("num_seqs, num_heads, max_seq_len, expected", [
    (1, 32, 512, True),      # one partition
    (8, 32, 2048, False),    # 256 heads x seqs <= 512 and 4 partitions
    (64, 32, 8192, True),    # 2048 > 512
    (256, 64, 32768, False),  # longer than 8192
    (16, 32, 8192, False),   # exactly 512 is not more than 512
    (17, 32, 8192, True),
])
def test_vllm_entry_point_rule(bench, num_seqs, num_heads, max_seq_len, expected):
    assert bench.vllm_uses_v1(num_seqs, num_heads, max_seq_len) is expected


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_sdpa_without_enable_gqa_passes_grouped_queries(bench, heads):
    """Torch before 2.5 (the BI-V100's 2.1) has no enable_gqa: a KV head's query heads go to SDPA as that many
    queries of one sequence. Same answer as enable_gqa and as attention written out, and K/V are not repeated."""
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, num_heads, 64, generator=generator)
    key = torch.randn(3, num_kv_heads, 40, 64, generator=generator)
    value = torch.randn(3, num_kv_heads, 40, 64, generator=generator)
    grouped, how = bench.decode_sdpa(query, key, value, 0.125, gqa=False)
    assert how == ("grouped queries" if num_heads != num_kv_heads else "none needed")
    out = grouped().reshape(query.shape)
    kv_of_head = torch.arange(num_heads) // (num_heads // num_kv_heads)  # vLLM's query head -> KV head
    weights = torch.einsum("shd,shtd->sht", query, key[:, kv_of_head]).mul(0.125).softmax(-1)
    torch.testing.assert_close(out, torch.einsum("sht,shtd->shd", weights, value[:, kv_of_head]))
    if bench.sdpa_supports_gqa():
        with_gqa, _ = bench.decode_sdpa(query, key, value, 0.125, gqa=True)
        torch.testing.assert_close(out, with_gqa().reshape(query.shape))


def test_rows_run_sdpa_without_enable_gqa(bench):
    runner = bench.RowRunner(bench.parse_args([]), torch.device("cpu"), [], use_sdpa=True, gqa=False,
                             warmup_ms=0, rep_ms=1, copy_gbps=1.0)
    row = {"dtype": "fp32", "num_heads": 8, "num_kv_heads": 2, "num_seqs": 2, "seq_len": 48,
           "kv_bytes": bench.kv_bytes(2, 48, 2, 4), "vllm_entry": "v1"}
    generator = torch.Generator().manual_seed(0)
    results, _ = runner.run(row, bench.CachePool(torch.float32, 2, 16, torch.device("cpu"), generator), generator)
    assert results["sdpa"]["gqa"] == "grouped queries"
    assert results["sdpa"]["ok"] and results["sdpa"]["rel_err_vs_fp32"] < 1e-5, results["sdpa"]


class _WrongBackend:
    """Writes a plausible but wrong answer (the mean of V would be right only for uniform attention)."""

    def paged_attention_v1(self, out, query, *rest):
        out.copy_(query)

    def paged_attention_v2(self, out, exp_sums, max_logits, tmp_out, query, *rest):
        out.copy_(query)


class _RaisingBackend:
    def paged_attention_v1(self, *args):
        raise RuntimeError("kernel exploded")

    paged_attention_v2 = paged_attention_v1


def test_wrong_and_failing_backends_are_flagged(bench):
    device = torch.device("cpu")
    series = [bench.Series("wrong", "triton", _WrongBackend()), bench.Series("raising", "torch", _RaisingBackend()),
              bench.Series("missing", "torch", error="ModuleNotFoundError: no backend")]
    runner = bench.RowRunner(bench.parse_args([]), device, series, use_sdpa=True, gqa=bench.sdpa_supports_gqa(),
                             warmup_ms=0, rep_ms=1, copy_gbps=1.0)
    row = {"dtype": "fp16", "num_heads": 4, "num_kv_heads": 2, "num_seqs": 2, "seq_len": 48,
           "kv_bytes": bench.kv_bytes(2, 48, 2, 2), "vllm_entry": "v1"}
    generator = torch.Generator().manual_seed(0)
    pool = bench.CachePool(torch.float16, 2, 16, device, generator)
    results, _ = runner.run(row, pool, generator)
    assert results["sdpa"]["ok"]
    for name in ("wrong_v1", "wrong_v2", "wrong", "wrong_best"):
        assert results[name]["ok"] is False and results[name]["flag"].startswith("WRONG")
        assert results[name]["us"] > 0  # still timed, still shown
    assert results["raising"]["failed"] == "RuntimeError: kernel exploded"
    assert results["raising"]["ok"] is False and "us" not in results["raising"]
    assert results["missing"]["unavailable"] is True
    row["results"], row["notes"] = results, []
    problems = bench._row_problems(row)
    assert any(p.startswith("wrong_v1 WRONG") for p in problems)
    assert any("raising failed" in p for p in problems)
    assert not any("missing" in p for p in problems)  # reported once per run, not per row
