#!/usr/bin/env python
"""The PyTorch backend of this checkout against another one's, in one process, on a CUDA device.

Run from the repository root: ``python benchmarks/ab_torch_backend.py --baseline DIR`` where DIR holds the
other checkout's ``kernels`` package (``git archive <commit> kernels | tar -x -C DIR``). Each row (head 128,
block 16, random block tables, full-length sequences) is one validated call timed through both
``forward`` functions in interleaved rounds, the L2 flushed before each call: CUDA events around the call
(GPU time, or host time where the host is slower) and the CPU time of the call (host). Also records each
row's largest difference of ``out`` between the two and a host reference (``torch.add`` on one element,
timed like ``bench_paged_attention.py``'s).
Writes ``<results-dir>/torch_ab.json`` and prints one line per row.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common  # noqa: E402  (benchmarks/_common.py beside this file)
import torch  # noqa: E402
from kernels import contract, paged_attention_torch  # noqa: E402

ROWS = (  # dtype, (query heads, kv heads), sequences, tokens, op
    ("fp16", (32, 8), 8, 512, "v1"),
    ("fp16", (32, 8), 32, 2048, "v1"),
    ("fp16", (64, 8), 16, 2048, "v1"),
    ("bf16", (32, 8), 32, 2048, "v1"),
    ("fp16", (32, 8), 128, 2048, "v1"),
    ("fp16", (32, 8), 32, 8192, "v1"),
    ("fp16", (32, 32), 32, 2048, "v1"),
    ("fp16", (32, 8), 64, 8192, "v1"),
    ("fp16", (32, 8), 8, 2048, "v2"),
)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_SIZE, BLOCK_SIZE, PARTITION_SIZE = 128, 16, 512


def load_baseline(directory, module="paged_attention_torch"):
    """The ``module`` of the ``kernels`` package under ``directory``, as its own package (``baseline_kernels``)."""
    init = os.path.join(directory, "kernels", "__init__.py")
    if not os.path.isfile(init):
        sys.exit(f"--baseline: {directory!r} holds no kernels/__init__.py "
                 "(git archive <commit> kernels | tar -x -C DIR)")
    spec = importlib.util.spec_from_file_location("baseline_kernels", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["baseline_kernels"] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"baseline_kernels.{module}")


def make_call(dtype, heads, seqs, tokens, op, device):
    query_heads, kv_heads = heads
    blocks_per_seq = tokens // BLOCK_SIZE
    num_blocks = seqs * blocks_per_seq
    generator = torch.Generator(device=device).manual_seed(0)

    def uniform(*shape):
        return ((torch.rand(*shape, device=device, generator=generator) - 0.5) * 0.2).to(dtype)

    x = 16 // torch.empty((), dtype=dtype).element_size()
    key_cache = uniform(num_blocks, kv_heads, HEAD_SIZE // x, BLOCK_SIZE, x)
    value_cache = uniform(num_blocks, kv_heads, HEAD_SIZE, BLOCK_SIZE)
    tables = torch.randperm(num_blocks, device=device, generator=generator).to(torch.int32).view(seqs, blocks_per_seq)
    query = uniform(seqs, query_heads, HEAD_SIZE)
    lens = torch.full((seqs,), tokens, dtype=torch.int32, device=device)
    partition_buffers = {}
    if op == "v2":
        parts = -(-tokens // PARTITION_SIZE)
        partition_buffers = dict(exp_sums=torch.empty(seqs, query_heads, parts, device=device),
                                 max_logits=torch.empty(seqs, query_heads, parts, device=device),
                                 tmp_out=torch.empty(seqs, query_heads, parts, HEAD_SIZE, dtype=dtype, device=device))
    call = contract.check_call(torch.empty_like(query), query, key_cache, value_cache, kv_heads, HEAD_SIZE ** -0.5,
                               tables, lens, BLOCK_SIZE, tokens, None, "auto", 1.0, 1.0, **partition_buffers)
    return call, key_cache.nbytes + value_cache.nbytes


def timed(forward, call, flush):
    flush.zero_()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    forward(call)
    host = time.perf_counter() - began
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3, host * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a directory holding the other checkout's kernels package")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per row after 2 warm-up ones (default 10)")
    parser.add_argument("--results-dir", default=".", help="where torch_ab.json goes (default: here)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: must be at least 1; got {args.rounds}")
    versions = {"baseline": load_baseline(args.baseline).forward, "checkout": paged_attention_torch.forward}
    if not torch.cuda.is_available():
        sys.exit("ab_torch_backend.py times GPU work: it needs a CUDA device (torch.cuda.is_available() is false)")
    device = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    results = []
    for dtype, heads, seqs, tokens, op in ROWS:
        call, kv_bytes = make_call(DTYPES[dtype], heads, seqs, tokens, op, device)
        outputs = {}
        for name, forward in versions.items():
            forward(call)
            outputs[name] = call.out.float()
        samples = _common.interleaved_samples(versions, lambda forward: timed(forward, call, flush), args.rounds,
                                              warmup_rounds=2)
        entry = {"row": f"{dtype} {heads} {seqs}x{tokens} {op}", "kv_bytes": kv_bytes,
                 "max_abs_diff_out": float((outputs["baseline"] - outputs["checkout"]).abs().max())}
        for name, timings in samples.items():
            entry[name] = {"event_us": statistics.median(event for event, _ in timings),
                           "event_min_us": min(event for event, _ in timings),
                           "host_us": statistics.median(host for _, host in timings)}
        entry["event_speedup"] = entry["baseline"]["event_us"] / entry["checkout"]["event_us"]
        entry["host_speedup"] = entry["baseline"]["host_us"] / entry["checkout"]["host_us"]
        before, after = entry["baseline"], entry["checkout"]
        print(f"{entry['row']:30s} event {before['event_us']:8.1f} -> {after['event_us']:8.1f} us "
              f"({entry['event_speedup']:.2f}x)  host {before['host_us']:8.1f} -> {after['host_us']:8.1f} us "
              f"({entry['host_speedup']:.2f}x)", flush=True)
        results.append(entry)
        del call, outputs
        torch.cuda.empty_cache()
    one = torch.ones(1, device=device)
    torch_add_us = _common.host_call_us(lambda: torch.add(one, 1, out=one), device, 200)
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torch_add_host_us": torch_add_us,
               "results": results}
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "torch_ab.json"), "w") as handle:
        json.dump(payload, handle, indent=1)


if __name__ == "__main__":
    main()
