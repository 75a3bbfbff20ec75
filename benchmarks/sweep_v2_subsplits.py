#!/usr/bin/env python
"""v2's sub-splits per 512-token partition forced to each count, against the rule's pick, v1 and SDPA (CUDA).

Run from the repository root: ``python benchmarks/sweep_v2_subsplits.py``. Each row (head 128, block 16, random block
tables, full-length sequences, ``ab_torch_backend.make_call``) runs the Triton backend's v2 with
``configs.choose_subsplits`` as it is (``v2_rule``) and forced to 1, 2, 4 and 8 (``v2_subsN``; counts whose partition
reduce would need more than ``configs.REDUCE_MAX_SPLITS`` splits in one tile are left out), v1 on the same shape and
SDPA on the K/V made contiguous, each timed with ``triton.testing.do_bench`` (median, L2 flushed) in interleaved rounds
after a warm-up one; each figure is the median over rounds. Also per row: the rule's sub-split count, v1's splits,
and each v2 variant's largest difference from SDPA (``_err``).
Writes ``<results-dir>/v2_subs_sweep[-TAG].json`` and prints one line per row.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/ beside this file)
import ab_torch_backend  # noqa: E402
import ab_triton_backend  # noqa: E402
import torch  # noqa: E402
from kernels import configs, paged_attention_triton  # noqa: E402
from kernels.contract import PARTITION_SIZE  # noqa: E402
from kernels.limits import DeviceLimits  # noqa: E402

HEADS = ((32, 8), (64, 8), (32, 32))
SHAPES = ((1, 2048), (1, 4096), (1, 8192), (2, 2048), (8, 2048), (2, 8192), (8, 8192), (1, 16384), (1, 32768))
FORCED_COUNTS = (1, 2, 4, 8)


def forced_subsplits(rule):
    """``configs.choose_subsplits`` that returns ``forced["subs"]`` while it is set, else the rule's pick."""
    forced = {"subs": None}

    def choose(*args):
        return forced["subs"] or rule(*args)

    return choose, forced


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(ab_torch_backend.DTYPES), default="fp16",
                        help="query and cache dtype")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per row after a warm-up one (default 3)")
    parser.add_argument("--rep-ms", type=float, default=40.0, help="do_bench's repetition budget per timing (ms)")
    parser.add_argument("--results-dir", default=".", help="where v2_subs_sweep[-TAG].json goes (default: here)")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1; got {args.rounds}")
    if args.rep_ms <= 0:
        parser.error(f"--rep-ms: must be positive; got {args.rep_ms}")
    if not torch.cuda.is_available():
        sys.exit("sweep_v2_subsplits.py times GPU work: it needs a CUDA device (torch.cuda.is_available() is false)")
    device = torch.device("cuda")
    limits = DeviceLimits.from_torch_device(device)
    dtype = ab_torch_backend.DTYPES[args.dtype]
    choose, forced = forced_subsplits(configs.choose_subsplits)
    configs.choose_subsplits = choose
    rows = []
    for heads in HEADS:
        for seqs, tokens in SHAPES:
            v2, kv_bytes = ab_torch_backend.make_call(dtype, heads, seqs, tokens, "v2", device)
            v1, _ = ab_torch_backend.make_call(dtype, heads, seqs, tokens, "v1", device)
            sdpa = ab_triton_backend.contiguous_sdpa(v2)
            expected = sdpa().squeeze(2).float()
            entry = {"row": f"{args.dtype} {heads} {seqs}x{tokens}", "kv_mb": round(kv_bytes / 1e6, 1),
                     "v1_splits": paged_attention_triton._plan(v1, limits).splits_for(v1)[:2],
                     "rule_subs": paged_attention_triton._plan(v2, limits).splits_for(v2)[2]}
            calls = {"sdpa": sdpa}
            forward = paged_attention_triton.make_forward(limits)
            calls["v1"] = (lambda forward: lambda: forward(v1))(forward)
            partitions = -(-tokens // PARTITION_SIZE)
            for subs in (None,) + FORCED_COUNTS:
                if subs and not configs.subsplits_fit_reduce_tile(partitions, subs):
                    continue
                name = f"v2_subs{subs}" if subs else "v2_rule"
                forward = paged_attention_triton.make_forward(limits)
                forced["subs"] = subs
                v2.out.fill_(float("nan"))
                forward(v2)  # plans (and caches) the forced count for this max_seq_len
                forced["subs"] = None
                entry[name + "_err"] = float((v2.out.float() - expected).abs().max())
                calls[name] = (lambda forward: lambda: forward(v2))(forward)
            samples = _common.interleaved_samples(calls, lambda fn: _common.bench_us(fn, device, args.rep_ms / 4,
                                                                                     args.rep_ms), args.rounds)
            for name, timings in samples.items():
                entry[name] = round(statistics.median(timings), 2)
            print(f"{entry['row']:28s} rule {entry['rule_subs']}  " + "  ".join(
                f"{name} {entry[name]:.2f}" for name in calls), flush=True)
            rows.append(entry)
            del v1, v2, calls, sdpa
            torch.cuda.empty_cache()
    name = "v2_subs_sweep" + (f"-{args.tag}" if args.tag else "") + ".json"
    os.makedirs(args.results_dir, exist_ok=True)
    _common.write_json(os.path.join(args.results_dir, name), {"environment": _common.environment(device),
                                                              "rounds": args.rounds, "rep_ms": args.rep_ms,
                                                              "rows": rows})


if __name__ == "__main__":
    main()
