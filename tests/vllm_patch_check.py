"""Run inside a venv that holds real vLLM (see .ci/make_vllm_env.sh): patch it, decode, compare, revert.

    python tests/vllm_patch_check.py BACKEND[,BACKEND...] [--apply-before-import] [--verify] [--dtype float32]

Prints one JSON object (the last line of stdout: vLLM logs to stdout too), per backend: for each of vLLM's own ``PagedAttention.forward_decode`` paths (v1, v2)
and a direct ``torch.ops._C.paged_attention_v2`` call, which of our ops ran and the max abs
error against the float64 reference (tests/reference.py), plus what ``revert()`` left. The test
(tests/test_patch_vllm.py) asserts on it; this script asserts nothing itself, so that one run
reports every check.
"""

import argparse
import inspect
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_case(torch, dtype, seq_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=0):
    """A paged decode case with shuffled block tables (each sequence's blocks scattered)."""
    generator = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    width = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = order[used:used + count].to(torch.int32)
        used += count

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator) * 2 - 1).to(dtype)

    return {
        "query": uniform(len(seq_lens), num_heads, head_size),
        "key_cache": uniform(num_blocks, num_kv_heads, head_size // x, block_size, x),
        "value_cache": uniform(num_blocks, num_kv_heads, head_size, block_size),
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "max_seq_len": max(seq_lens),
        "num_kv_heads": num_kv_heads,
        "scale": head_size ** -0.5,
        "alibi_slopes": None,
        "kv_cache_dtype": "auto",
        "block_size": block_size,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("backends")
    parser.add_argument("--apply-before-import", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--verify", action="store_true", help="also run biv100-patch verify's check")
    args = parser.parse_args()

    import biv100_patch.patches as patches
    backends = args.backends.split(",")
    reports = {}
    if args.apply_before_import:
        reports["apply_before_import"] = patches.apply(backends[0])
        reports["state_before_import"] = patches.state()["status"]

    import vllm._custom_ops as ops

    if args.apply_before_import:
        reports["patched_at_import"] = getattr(ops.paged_attention_v1, "biv100_patch", None) is not None
        reports["state_at_import"] = patches.state()["status"]
        patches.revert()
    for backend in backends:
        reports[backend] = check(patches, ops, backend, args.dtype)
    if args.verify:
        from biv100_patch.patches.verify import verify
        lines = []
        reports["verify"] = {"ok": verify(backend=backends[0], echo=lines.append)["ok"], "lines": lines}
        patches.revert()
    print(json.dumps(reports, default=str))


def check(patches, ops, backend, dtype_name):
    import torch
    from vllm.attention.ops.paged_attn import PagedAttention

    from tests.reference import reference_attention

    report = {}
    originals = {name: ops.__dict__[name] for name in ("paged_attention_v1", "paged_attention_v2")}
    report["decision"] = patches.apply(backend)
    state = patches.state()
    report["state"] = state
    ours = getattr(ops.paged_attention_v1, "biv100_patch", None)
    report["ours"] = ours is not None and getattr(ops.paged_attention_v2, "biv100_patch", None) is ours
    report["originals_wrapped"] = {n: hasattr(f, "__wrapped__") for n, f in originals.items()}
    if not report["ours"]:
        return report

    calls = []
    for name in ("paged_attention_v1", "paged_attention_v2"):
        method = getattr(ours, name)

        def counted(*a, _method=method, _name=name, **k):
            calls.append(_name)
            return _method(*a, **k)
        setattr(ours, name, counted)

    dtype = getattr(torch, dtype_name)
    tensor_scales = state["family"] == "0.7.0-0.24.x"
    one = torch.tensor(1.0, dtype=torch.float32) if tensor_scales else 1.0
    parameters = inspect.signature(PagedAttention.forward_decode).parameters
    tolerance = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype_name]
    # vLLM's rule: use_v1 = max_seq_len <= 8192 and (partitions == 1 or num_seqs * num_heads > 512)
    for label, seq_lens in (("v1", [5, 37, 100]), ("v2", [600, 1300])):
        case = make_case(torch, dtype, seq_lens)
        available = dict(case, k_scale=one, v_scale=one, kv_scale=1.0, tp_rank=0, blocksparse_local_blocks=0,
                         blocksparse_vert_stride=0, blocksparse_block_size=64, blocksparse_head_sliding_step=0)
        del calls[:]
        out = PagedAttention.forward_decode(**{n: available[n] for n in parameters if n in available})
        expected = reference_attention(**case)["out"]
        error = (out.to(torch.float64) - expected).abs().max().item()
        report[label] = {"calls": list(calls), "max_error": error, "ok": error <= tolerance,
                         "finite": bool(torch.isfinite(out).all())}

    # The dispatcher entry, called the way vLLM's own kernel tests call it.
    case = make_case(torch, dtype, [600, 1300], seed=1)
    partitions = math.ceil(case["max_seq_len"] / 512)
    num_seqs, num_heads, head_size = case["query"].shape
    out = torch.full_like(case["query"], math.nan)
    exp_sums = torch.full((num_seqs, num_heads, partitions), math.nan, dtype=torch.float32)
    max_logits = torch.full_like(exp_sums, math.nan)
    tmp_out = torch.full((num_seqs, num_heads, partitions, head_size), math.nan, dtype=dtype)
    del calls[:]
    report["dispatcher_state"] = state.get("dispatcher")
    try:
        scales = (one, one) if state["family"] != "0.4.3-0.5.2" else (1.0,)
        torch.ops._C.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, case["query"], case["key_cache"], case["value_cache"],
            case["num_kv_heads"], case["scale"], case["block_tables"], case["seq_lens"], case["block_size"],
            case["max_seq_len"], None, "auto", *scales, 0, 0, 0, 64, 0)
        expected = reference_attention(**case)
        error = (out.to(torch.float64) - expected["out"]).abs().max().item()
        written = expected["written"]
        sum_error = ((exp_sums.to(torch.float64) - expected["exp_sums"]).abs() / expected["exp_sums"].abs())[written]
        report["torch_ops"] = {"calls": list(calls), "max_error": error, "ok": error <= tolerance,
                               "exp_sums_max_rel_error": sum_error.max().item(),
                               "unwritten_still_nan": bool(torch.isnan(exp_sums[~written]).all())}
    except Exception as error:  # reported, and the test fails on it
        report["torch_ops"] = {"error": f"{type(error).__name__}: {error}"}

    report["revert"] = patches.revert()
    report["restored"] = all(ops.__dict__[n] is originals[n] for n in originals)
    report["state_after_revert"] = patches.state()["status"]
    report["torch_ops_after_revert"] = hasattr(torch.ops._C, "paged_attention_v2")
    report["reapply"] = patches.apply(backend)["backend"]
    report["reapplied_ours"] = getattr(ops.paged_attention_v1, "biv100_patch", None) is not None
    report["routed_to_torch"] = patches.state()["routed_to_torch"]
    patches.revert()
    return report


if __name__ == "__main__":
    main()
