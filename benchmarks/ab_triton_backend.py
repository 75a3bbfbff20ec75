#!/usr/bin/env python
"""The Triton backend of this checkout against another one's, and SDPA, in one process, on a CUDA device.

Run from the repository root: ``python benchmarks/ab_triton_backend.py --baseline DIR`` where DIR holds the
other checkout's ``kernels`` package (``git archive <commit> kernels | tar -x -C DIR``). Each row (head 128,
block 16, random block tables, full-length sequences, ``ab_torch_backend.make_call``) is one validated call
timed with ``triton.testing.do_bench`` (median, L2 flushed before each call) in interleaved rounds: the
baseline's ``forward``, this checkout's, and SDPA on the same K/V made contiguous; each row's figure is the
median over rounds. Also per row: the split count of this checkout's plan (v2: partitions x sub-splits), each
version's host time per call (CPU clock, ``_common.host_call_us``), its largest difference from SDPA, and how
many of 100 repeated calls differ bit for bit from the first.
Writes ``<results-dir>/triton_ab[-TAG].json`` and prints one line per row.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/ beside this file)
import ab_torch_backend  # noqa: E402
import bench_paged_attention  # noqa: E402
import torch  # noqa: E402
from kernels import paged_attention_triton  # noqa: E402
from kernels.limits import DeviceLimits  # noqa: E402

ROWS = (  # dtype, (query heads, kv heads), sequences, tokens, op
    ("fp16", (32, 8), 1, 512, "v1"),
    ("fp16", (32, 8), 8, 512, "v1"),
    ("fp16", (32, 8), 32, 512, "v1"),
    ("fp16", (32, 8), 128, 512, "v1"),
    ("fp16", (32, 8), 1, 1024, "v1"),
    ("fp16", (32, 8), 1, 2048, "v1"),
    ("fp16", (32, 8), 8, 2048, "v1"),
    ("fp16", (32, 8), 4, 1024, "v1"),
    ("fp16", (64, 8), 1, 512, "v1"),
    ("fp16", (64, 8), 4, 512, "v1"),
    ("fp16", (64, 8), 8, 512, "v1"),
    ("fp16", (64, 8), 8, 1024, "v1"),
    ("fp16", (32, 32), 1, 512, "v1"),
    ("fp16", (32, 32), 8, 512, "v1"),
    ("fp16", (32, 32), 1, 1024, "v1"),
    ("fp16", (32, 32), 1, 2048, "v1"),
    ("bf16", (32, 8), 8, 512, "v1"),
    # v2: vLLM's 512-token partitions, cut into sub-splits where the grid is small
    ("fp16", (32, 8), 1, 2048, "v2"),
    ("fp16", (32, 8), 2, 2048, "v2"),
    ("fp16", (32, 8), 8, 2048, "v2"),
    ("fp16", (32, 8), 1, 8192, "v2"),
    ("fp16", (32, 8), 8, 8192, "v2"),
    ("fp16", (32, 8), 1, 16384, "v2"),
    ("fp16", (32, 8), 1, 32768, "v2"),
    ("fp16", (64, 8), 8, 2048, "v2"),
    ("fp16", (64, 8), 1, 8192, "v2"),
    ("fp16", (64, 8), 1, 32768, "v2"),
    ("fp16", (32, 32), 1, 2048, "v2"),
    ("fp16", (32, 32), 1, 4096, "v2"),
    ("fp16", (32, 32), 1, 8192, "v2"),
    ("bf16", (32, 8), 1, 8192, "v2"),
)
ENTRY_POINTS = ("v1", "v2")
REPEATS = 100


def contiguous_sdpa(call):
    """SDPA on the call's K/V made contiguous (``bench_paged_attention.contiguous_kv``), one query per sequence
    (``bench_paged_attention.decode_sdpa``); its output reshapes to ``call.out``'s shape."""
    key, value = bench_paged_attention.contiguous_kv(call.key_cache, call.value_cache, call.block_tables,
                                                     call.max_seq_len)
    sdpa, _ = bench_paged_attention.decode_sdpa(call.query, key, value, call.scale,
                                                bench_paged_attention.sdpa_supports_gqa())
    return sdpa


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a directory holding the other checkout's kernels package")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per row after a warm-up one (default 5)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench's repetition budget per timing (ms)")
    parser.add_argument("--results-dir", default=".", help="where triton_ab[-TAG].json goes (default: here)")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--entry", action="append", choices=ENTRY_POINTS,
                        help="only the rows of this entry point (repeatable; default: v1 and v2)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1; got {args.rounds}")
    if args.rep_ms <= 0:
        parser.error(f"--rep-ms: must be positive; got {args.rep_ms}")
    baseline = ab_torch_backend.load_baseline(args.baseline, "paged_attention_triton")
    if not torch.cuda.is_available():
        sys.exit("ab_triton_backend.py times GPU work: it needs a CUDA device (torch.cuda.is_available() is false)")
    device = torch.device("cuda")
    limits = DeviceLimits.from_torch_device(device)
    forwards = {"baseline": baseline.make_forward(), "checkout": paged_attention_triton.make_forward()}
    results = []
    entry_points = set(args.entry or ENTRY_POINTS)
    for dtype, heads, seqs, tokens, op in (row for row in ROWS if row[4] in entry_points):
        call, kv_bytes = ab_torch_backend.make_call(ab_torch_backend.DTYPES[dtype], heads, seqs, tokens, op, device)
        sdpa = contiguous_sdpa(call)
        expected = sdpa().reshape(call.out.shape).float()
        entry = {"row": f"{dtype} {heads} {seqs}x{tokens} {op}", "kv_bytes": kv_bytes,
                 "splits": paged_attention_triton._plan(call, limits).splits_for(call)[0]}
        calls = {"sdpa": sdpa}
        for name, forward in forwards.items():
            call.out.fill_(float("nan"))
            forward(call)
            first = call.out.clone()
            differing = 0
            for _ in range(REPEATS):
                forward(call)
                differing += not torch.equal(call.out, first)
            entry[name] = {"max_abs_diff_vs_sdpa": float((first.float() - expected).abs().max()),
                           "repeats_differing": differing,
                           "host_us": _common.host_call_us(lambda: forward(call), device, 200)}
            calls[name] = (lambda forward: lambda: forward(call))(forward)
        samples = _common.interleaved_samples(calls, lambda fn: _common.bench_us(fn, device, args.rep_ms / 4,
                                                                                 args.rep_ms), args.rounds)
        for name, timings in samples.items():
            entry.setdefault(name, {})["us"] = statistics.median(timings)
            entry[name]["rounds_us"] = timings
        entry["speedup"] = entry["baseline"]["us"] / entry["checkout"]["us"]
        before, after = entry["baseline"], entry["checkout"]
        print(f"{entry['row']:30s} splits {entry['splits']:3d}  {before['us']:7.2f} -> {after['us']:7.2f} us "
              f"({entry['speedup']:.2f}x, SDPA {entry['sdpa']['us']:7.2f})  host {before['host_us']:5.1f} -> "
              f"{after['host_us']:5.1f} us  diff vs SDPA {before['max_abs_diff_vs_sdpa']:.1e} / "
              f"{after['max_abs_diff_vs_sdpa']:.1e}  repeats differing {before['repeats_differing']} / "
              f"{after['repeats_differing']}", flush=True)
        results.append(entry)
        del call, calls, sdpa
        torch.cuda.empty_cache()
    payload = {"environment": _common.environment(device), "rounds": args.rounds, "rep_ms": args.rep_ms,
               "results": results}
    name = "triton_ab" + (f"-{args.tag}" if args.tag else "") + ".json"
    os.makedirs(args.results_dir, exist_ok=True)
    _common.write_json(os.path.join(args.results_dir, name), payload)


if __name__ == "__main__":
    main()
