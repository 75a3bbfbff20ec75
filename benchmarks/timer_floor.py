#!/usr/bin/env python
"""What the benchmark's timer and v1's reduce launch cost, on a CUDA device (run from the repository root).

(1) The timer's floor: an empty Triton kernel and a 1-element torch.add timed like do_bench (events around the
call, the L2 flushed before each), and triton.testing.do_bench itself. (2) do_bench's flush is a zero_ of 256 MB,
which leaves the L2 full of dirty lines that the timed call then writes back; every row is timed after that
flush ("dirty") and after a read-only flush, a sum over the same 256 MB ("clean"). (3) v1's separate reduce:
each row through the Triton backend's v1 as it is, and with the reduce launch left out ("attn_only": wrong
outputs, timing only), against SDPA on the same K/V made contiguous. Fp16, head 128, block 16, random block
tables; medians of 200 calls. Writes benchmarks/results/<gpu>/timer_floor.json.
"""
import json, os, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton
import kernels
from kernels import paged_attention_triton as pat
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from bench_paged_attention import BLOCK_SIZE, HEAD_SIZE, CachePool, decode_sdpa, sdpa_supports_gqa  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("timer_floor.py times GPU kernels: it needs a CUDA device (torch.cuda.is_available() is false)")
dev = torch.device("cuda")
flush_buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=dev)
sink = torch.empty((), dtype=torch.int64, device=dev)

def flush_dirty():
    flush_buf.zero_()

def flush_clean():
    torch.sum(flush_buf, dim=0, out=sink)  # reads 256 MB: L2 ends full of clean lines

def timed(fn, flush, reps=200):
    fn(); torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record(); fn(); ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000

@triton.jit
def _empty(x):
    pass

def rows():
    for heads in ((32, 8), (32, 32)):
        for ns, L in ((1, 512), (8, 512), (32, 512), (1, 2048), (8, 2048), (1, 8192), (128, 512), (32, 2048), (8, 8192)):
            yield heads, ns, L

def make(heads, ns, L, dtype=torch.float16):
    """The row's query, its output, its paged cache (a CachePool), block tables and sequence lengths."""
    hq, hk = heads
    blocks_per_seq = L // BLOCK_SIZE
    pool = CachePool(dtype, hk, ns * blocks_per_seq, dev, generator=None)
    tables = torch.randperm(pool.num_blocks, device=dev, dtype=torch.int32).view(ns, blocks_per_seq)
    lens = torch.full((ns,), L, dtype=torch.int32, device=dev)
    q = torch.randn(ns, hq, HEAD_SIZE, dtype=dtype, device=dev)
    return q, torch.empty_like(q), pool, tables, lens

results = {"device": torch.cuda.get_device_name(), "floor": {}, "rows": []}
x1 = torch.zeros(1, device=dev)
for name, flush in (("dirty", flush_dirty), ("clean", flush_clean)):
    results["floor"][name] = {
        "empty_triton": timed(lambda: _empty[(1,)](x1), flush),
        "torch_add_1": timed(lambda: x1.add_(1), flush),
        "do_bench_empty": 1000 * triton.testing.do_bench(lambda: _empty[(1,)](x1), return_mode="median"),
    }
print(json.dumps(results["floor"]), flush=True)

backend = kernels.get_backend("triton")
real_reduce = pat._reduce
def no_reduce(*args, **kwargs):
    pass
for heads, ns, L in rows():
    q, out, pool, tables, lens = make(heads, ns, L)
    args = (pool.key, pool.value, heads[1], HEAD_SIZE ** -0.5, tables, lens, BLOCK_SIZE, L, None, "auto", 1.0, 1.0)
    full = lambda: backend.paged_attention_v1(out, q, *args)
    kc, vc = pool.contiguous(tables, L)
    sdpa, _ = decode_sdpa(q, kc, vc, HEAD_SIZE ** -0.5, sdpa_supports_gqa())
    full()
    rec = {"heads": heads, "ns": ns, "L": L, "kv_mb": 2 * pool.key.numel() * pool.key.element_size() / 1e6}
    for fname, flush in (("dirty", flush_dirty), ("clean", flush_clean)):
        rec[f"v1_{fname}"] = timed(full, flush)
        rec[f"sdpa_{fname}"] = timed(sdpa, flush)
        pat._reduce = no_reduce
        try:
            rec[f"attn_only_{fname}"] = timed(full, flush)
        finally:
            pat._reduce = real_reduce
    rec["do_bench_v1"] = 1000 * triton.testing.do_bench(full, return_mode="median")
    results["rows"].append(rec)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
    del q, out, pool, kc, vc
    torch.cuda.empty_cache()
results["environment"] = _common.environment(dev)
path = _common.results_dir(_common.DEFAULT_RESULTS_ROOT, dev) / "timer_floor.json"
path.write_text(json.dumps(results, indent=1))
print(f"wrote {path}", flush=True)
