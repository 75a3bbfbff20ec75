#!/usr/bin/env python
"""Paged-attention decode benchmark: our Triton and PyTorch backends against SDPA and the device-copy ceiling.

Grid (issue 7): dtype x heads (query, kv) x num_seqs x seq_len, head size 128, block size 16, every sequence
seq_len tokens long, block tables a random permutation of cache blocks. Rows whose K+V exceed --max-kv-gb
(40 GB) or do not fit the device (cache + SDPA's contiguous copy) are skipped with a note.

Per row:
  triton_v1 / triton_v2   our Triton backend through vLLM's paged_attention_v1 / _v2 entry points;
  triton                  the entry point vLLM would pick (use_v1 = max_seq_len <= 8192 and
                          (max_num_partitions == 1 or num_seqs * num_heads > 512)); triton_best the faster one;
  triton_smem<N>_*        the same with DeviceLimits(shared memory = N) (--shared-memory-limit N);
  torch                   our PyTorch backend through vLLM's pick, with its peak extra device memory;
  sdpa                    torch.nn.functional.scaled_dot_product_attention on the same K/V made contiguous
                          (one query per sequence; GQA through enable_gqa, else as grouped queries).
Times are medians in us (CUDA: triton.testing.do_bench, L2 flushed before each call; v2's scratch buffers
are allocated once, outside the timer). GB/s counts the K+V bytes read once (query, output and block tables
are not counted: they are < 0.5% of the bytes on every row of at least 1 MB). "% copy" is that against a
device-to-device copy measured in the same run, counting bytes read plus bytes written.
Correctness, once per row and series (output poisoned with NaN first): relative L2 error and max abs error
against SDPA, and against a float32 reference for the first sequences; a series over its tolerance is
flagged "WRONG", a series that raises is reported "failed" and the run goes on.
Also: host-side cost of one v1 call on a tiny input (CPU clock over many calls, no device wait).

Writes <results-dir>/<gpu-name-slug>/paged_attention[-TAG].{json,md,png}; the JSON is rewritten after every
row, so a run cut short keeps what it measured. On a CPU-only machine (--device cpu) it runs the torch backend
and SDPA; the Triton backend needs TRITON_INTERPRET=1 there, which is far too slow to benchmark, so it is
skipped unless asked for with --backends.

Examples:
  python benchmarks/bench_paged_attention.py --dry-run                      # rows, skips, runtime estimate
  python benchmarks/bench_paged_attention.py --shared-memory-limit 49152   # full grid + the 48 KB series
  python benchmarks/bench_paged_attention.py --quick --tag quick
  python benchmarks/bench_paged_attention.py --device cpu --heads 4x2 --num-seqs 2 --seq-lens 32,600
"""

import argparse
import functools
import importlib
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402  (benchmarks/_common.py beside this file)

HEAD_SIZE = 128
BLOCK_SIZE = 16
PARTITION_SIZE = 512  # vLLM's, as in kernels/contract.py
DTYPE_NAMES = ("fp16", "bf16", "fp32")
DEFAULT_DTYPES = ("fp16", "bf16")
DEFAULT_HEADS = ((32, 8), (32, 32), (64, 8))
DEFAULT_NUM_SEQS = (1, 8, 32, 64, 128, 256)
DEFAULT_SEQ_LENS = (512, 2048, 8192, 32768)
# --quick: the reference rows (fp16, heads (32, 8)) and their neighbours.
QUICK = {"dtypes": ("fp16",), "heads": ((32, 8),), "num_seqs": (1, 64, 256), "seq_lens": (512, 2048, 8192, 32768)}
BACKENDS = ("triton", "torch", "sdpa")
# Relative L2 error allowed against SDPA (two implementations in the same precision) and against float32.
TOLERANCE = {"fp16": 5e-3, "bf16": 2e-2, "fp32": 2e-3}
REFERENCE_SEQS = 4  # sequences checked against the float32 reference
GATHER_CHUNK_BYTES = 1 << 30  # SDPA's contiguous copy is built this many source bytes at a time
MEMORY_MARGIN_BYTES = 4 << 30  # kept free on the device: v2 scratch, allocator slack, SDPA's workspace
MAX_PRINTED_PROBLEMS = 30  # on the console; the markdown lists them all
# Bandwidths assumed by the runtime estimate only (bytes/s on CUDA; the CPU figure is a guess for tiny grids).
ASSUMED_BANDWIDTH = {"cuda": {"triton": 3.5e12, "torch": 1.0e12, "sdpa": 3.5e12}, "cpu": {"*": 5e9}}
# A call slower than this is timed over a few synchronised calls: do_bench would make at least eight.
SLOW_CALL_S = 0.25
SLOW_CALL_REPEATS = 3
ASSUMED_COMPILE_S = 3.0  # per Triton (dtype, heads, entry point, limits) configuration


def _int_list(text):
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _heads_list(text):
    shapes = []
    for part in text.split(","):
        pieces = part.strip().replace(":", "x").replace("/", "x").split("x")
        try:
            num_heads, num_kv_heads = (int(p) for p in pieces)
        except ValueError:
            raise argparse.ArgumentTypeError(f"heads: expected Q x KV pairs like 32x8,64x8; got {part!r}") from None
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise argparse.ArgumentTypeError(f"heads: KV heads must divide query heads; got {part!r}")
        shapes.append((num_heads, num_kv_heads))
    return tuple(shapes)


def _name_list(allowed, what):
    def parse(text):
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [name for name in names if name not in allowed]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"{what}: choose from {', '.join(allowed)}; got {text!r}")
        return names
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = parser.add_argument_group("grid (defaults: the full grid of issue 7)")
    grid.add_argument("--dtypes", type=_name_list(DTYPE_NAMES, "dtypes"), help="e.g. fp16,bf16")
    grid.add_argument("--heads", type=_heads_list, help="query x KV heads, e.g. 32x8,32x32,64x8")
    grid.add_argument("--num-seqs", type=_int_list, help="e.g. 1,8,32,64,128,256")
    grid.add_argument("--seq-lens", type=_int_list, help="tokens per sequence, e.g. 512,2048,8192,32768")
    grid.add_argument("--quick", action="store_true",
                      help="fp16, heads 32x8, num_seqs 1,64,256, all seq_lens (the options above override parts)")
    grid.add_argument("--max-kv-gb", type=float, default=40.0, help="skip rows whose K+V exceed this (1e9 bytes)")
    parser.add_argument("--backends", type=_name_list(BACKENDS, "backends"),
                        help=f"subset of {','.join(BACKENDS)} (default: all; on the CPU triton is left out)")
    parser.add_argument("--shared-memory-limit", type=int, metavar="BYTES",
                        help="also run the Triton backend with DeviceLimits capped at this shared memory per block "
                             "(49152 = a BI-V100), reported as the series triton_smem<BYTES>")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--budget-seconds", type=float, default=420.0,
                        help="size the repetitions so that the whole run should take about this long (default 420)")
    timing.add_argument("--rep-ms", type=float, help="do_bench repetition budget per measurement (overrides the budget)")
    timing.add_argument("--warmup-ms", type=float, help="do_bench warm-up budget (default: a quarter of --rep-ms)")
    timing.add_argument("--copy-gib", type=float, help="size of the copy-ceiling buffer (default 4 on CUDA, 1/16 on CPU)")
    timing.add_argument("--launch-calls", type=int, help="calls per round for the host-overhead timer "
                        "(default 1000 on CUDA, 100 on CPU; 5 rounds, median)")
    output = parser.add_argument_group("output")
    output.add_argument("--results-dir", default=str(_common.DEFAULT_RESULTS_ROOT),
                        help="files go to RESULTS_DIR/<gpu-name-slug>/ (default benchmarks/results)")
    output.add_argument("--tag", default="", help="suffix for the file names: paged_attention-TAG.*")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print the rows, the skips and the estimate; run nothing")
    args = parser.parse_args(argv)
    if args.tag and _common.slug(args.tag) != args.tag:
        parser.error(f"--tag: use lower-case letters, digits and dashes only; got {args.tag!r}")
    if args.shared_memory_limit is not None and args.shared_memory_limit < 1024:
        parser.error(f"--shared-memory-limit: bytes per block, at least 1024; got {args.shared_memory_limit}")
    base = QUICK if args.quick else {"dtypes": DEFAULT_DTYPES, "heads": DEFAULT_HEADS,
                                     "num_seqs": DEFAULT_NUM_SEQS, "seq_lens": DEFAULT_SEQ_LENS}
    for key in base:
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    return args


# ----------------------------------------------------------------------------------------------- setup


def import_kernels():
    """This checkout's ``kernels`` package (the benchmark measures the tree it lives in)."""
    sys.path.insert(0, str(_common.REPO_ROOT))
    return importlib.import_module("kernels")


def limits_with_shared_memory(kernels, device, shared_memory_bytes):
    """``kernels.limits.DeviceLimits`` read from ``device``, capped at ``shared_memory_bytes`` per block.

    Tolerant of how the class spells things: ``from_torch_device`` as a module function or a class method;
    ``with_shared_memory_limit`` if it has one, else the one field whose name contains "shared" replaced
    (dataclass, namedtuple or plain object). On the CPU (Triton's interpreter) the base is
    ``kernels.configs.INTERPRETER_LIMITS`` where that exists.
    """
    import copy
    import dataclasses

    limits = importlib.import_module(kernels.__name__ + ".limits")
    read = getattr(limits, "from_torch_device", None) or getattr(limits.DeviceLimits, "from_torch_device")
    if device.type == "cpu":
        measured = getattr(importlib.import_module(kernels.__name__ + ".configs"), "INTERPRETER_LIMITS", None)
        if measured is None:
            measured = read(device)
    else:
        measured = read(device)
    if hasattr(measured, "with_shared_memory_limit"):
        return measured.with_shared_memory_limit(shared_memory_bytes)
    if dataclasses.is_dataclass(measured):
        names = [field.name for field in dataclasses.fields(measured)]
    elif hasattr(measured, "_fields"):
        names = list(measured._fields)
    else:
        names = [name for name in vars(measured) if not name.startswith("_")]
    shared = [name for name in names if "shared" in name.lower()]
    if len(shared) != 1:
        raise RuntimeError(f"DeviceLimits: expected one shared-memory field, found {shared or 'none'} in {names}")
    if dataclasses.is_dataclass(measured):
        return dataclasses.replace(measured, **{shared[0]: shared_memory_bytes})
    if hasattr(measured, "_replace"):
        return measured._replace(**{shared[0]: shared_memory_bytes})
    capped = copy.copy(measured)
    setattr(capped, shared[0], shared_memory_bytes)
    return capped


class Series:
    """One backend under test: a name, the backend object (or why there is none) and which entry points."""

    def __init__(self, name, kind, backend=None, error=None, note=None):
        self.name = name
        self.kind = kind  # "triton" (both entry points timed) or "torch" (vLLM's pick only)
        self.backend = backend
        self.error = error
        self.note = note


def make_series(args, device, kernels, notes):
    series = []
    wanted = args.backends
    if wanted is None:
        wanted = BACKENDS if device.type == "cuda" else ("torch", "sdpa")
        if device.type != "cuda":
            notes.append("Triton backend skipped on the CPU: it runs there only in Triton's interpreter "
                         "(TRITON_INTERPRET=1), far too slow to benchmark; pass --backends triton,... to force it.")
    if "triton" in wanted and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        notes.append("Triton backend on the CPU needs TRITON_INTERPRET=1 set before the run; reported as failed.")
    variants = [("triton", None)]
    if args.shared_memory_limit is not None:
        variants.append((f"triton_smem{args.shared_memory_limit}", args.shared_memory_limit))
    for name in wanted:
        if name == "triton":
            for series_name, shared_memory in variants:
                try:
                    limits = None if shared_memory is None else \
                        limits_with_shared_memory(kernels, device, shared_memory)
                    backend = kernels.get_backend("triton", limits=limits)
                except Exception as error:  # noqa: BLE001 - a missing backend is a failed series
                    series.append(Series(series_name, "triton", error=_describe(error)))
                else:
                    note = None if limits is None else f"limits: {limits!r}"
                    series.append(Series(series_name, "triton", backend, note=note))
        elif name == "torch":
            try:
                series.append(Series("torch", "torch", kernels.get_backend("torch")))
            except Exception as error:  # noqa: BLE001
                series.append(Series("torch", "torch", error=_describe(error)))
    return series


def _describe(error):
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def kv_bytes(num_seqs, seq_len, num_kv_heads, element_size):
    return 2 * num_seqs * seq_len * num_kv_heads * HEAD_SIZE * element_size


def vllm_uses_v1(num_seqs, num_heads, max_seq_len):
    """vLLM's PagedAttention.forward_decode choice between the v1 and v2 kernels."""
    max_num_partitions = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    return max_seq_len <= 8192 and (max_num_partitions == 1 or num_seqs * num_heads > 512)


def plan_rows(args, device):
    """The grid's rows in run order, and the skipped ones with their reasons."""
    import torch

    free = None
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    rows, skipped = [], []
    for dtype in args.dtypes:
        element_size = 4 if dtype == "fp32" else 2
        for num_heads, num_kv_heads in args.heads:
            for seq_len in args.seq_lens:
                for num_seqs in args.num_seqs:
                    row = {"dtype": dtype, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                           "num_seqs": num_seqs, "seq_len": seq_len,
                           "kv_bytes": kv_bytes(num_seqs, seq_len, num_kv_heads, element_size),
                           "vllm_entry": "v1" if vllm_uses_v1(num_seqs, num_heads, seq_len) else "v2"}
                    # The cache itself, plus SDPA's contiguous copy of it.
                    needed = 2 * row["kv_bytes"] + MEMORY_MARGIN_BYTES
                    if row["kv_bytes"] > args.max_kv_gb * 1e9:
                        skipped.append(dict(row, reason=f"K+V {row['kv_bytes'] / 1e9:.1f} GB > "
                                                        f"--max-kv-gb {args.max_kv_gb:g}"))
                    elif free is not None and needed > free:
                        skipped.append(dict(row, reason=f"needs {needed / 1e9:.1f} GB (cache + SDPA copy + margin),"
                                                        f" {free / 1e9:.1f} GB free"))
                    else:
                        rows.append(row)
    return rows, skipped


def timed_kinds(series):
    """The backend kind of each do_bench call a row makes (Triton series time both entry points)."""
    kinds = []
    for entry in series:
        if entry.backend is not None:
            kinds += [entry.kind] * (2 if entry.kind == "triton" else 1)
    return kinds


def estimate_seconds(rows, series, use_sdpa, device, warmup_ms, rep_ms):
    """A rough wall-clock estimate of the grid: do_bench budgets plus the calls it always makes."""
    bandwidth = ASSUMED_BANDWIDTH["cuda" if device.type == "cuda" else "cpu"]
    total = 15.0  # start-up, copy ceiling, launch-overhead timers
    configurations = set()
    for row in rows:
        kinds = timed_kinds(series) + (["sdpa"] if use_sdpa else [])
        for kind in kinds:
            call_s = row["kv_bytes"] / bandwidth.get(kind, bandwidth.get("*")) + 20e-6
            # do_bench: one call, five estimate calls, >= 1 warm-up and >= 1 timed call, plus our check call.
            total += max((warmup_ms + rep_ms) / 1000.0, 7 * call_s) + 2 * call_s + 0.03
        total += 4 * row["kv_bytes"] / bandwidth.get("sdpa", bandwidth.get("*")) + 0.05  # gathers, reference
        for entry in series:
            if entry.kind == "triton" and entry.backend is not None:
                configurations.add((entry.name, row["dtype"], row["num_heads"], row["num_kv_heads"]))
    return total + ASSUMED_COMPILE_S * 2 * len(configurations)


def choose_timing(args, rows, series, use_sdpa, device):
    """(warmup_ms, rep_ms): the options if given, else the largest do_bench budget the time budget allows."""
    if args.rep_ms is not None:
        return (args.warmup_ms if args.warmup_ms is not None else args.rep_ms / 4), args.rep_ms
    if device.type != "cuda":
        return 0.0, 20.0
    rep_ms = 100.0  # do_bench's default
    while rep_ms > 10.0 and estimate_seconds(rows, series, use_sdpa, device, rep_ms / 4, rep_ms) > args.budget_seconds:
        rep_ms *= 0.8
    return (args.warmup_ms if args.warmup_ms is not None else rep_ms / 4), rep_ms


# ----------------------------------------------------------------------------------------------- data


def contiguous_kv(key_cache, value_cache, block_tables, seq_len):
    """vLLM's paged K and V as [num_seqs, num_kv_heads, seq_len, head_size], gathered through ``block_tables``
    a chunk of sequences at a time (``GATHER_CHUNK_BYTES`` of cache)."""
    import torch

    num_seqs, blocks_per_seq = block_tables.shape
    _, num_kv_heads, head_size, _ = value_cache.shape
    shape = (num_seqs, num_kv_heads, seq_len, head_size)
    key = torch.empty(shape, dtype=key_cache.dtype, device=key_cache.device)
    value = torch.empty_like(key)
    per_seq = blocks_per_seq * key_cache[0].numel() * key_cache.element_size()
    chunk = max(1, GATHER_CHUNK_BYTES // per_seq)
    for start in range(0, num_seqs, chunk):
        blocks = block_tables[start:start + chunk].long()
        n = blocks.shape[0]
        # key block [kv_heads, head/x, block, x] -> [kv_heads, block, head]
        k = key_cache[blocks].permute(0, 2, 1, 4, 3, 5).reshape(n, num_kv_heads, -1, head_size)
        key[start:start + n].copy_(k[:, :, :seq_len])
        del k
        v = value_cache[blocks].permute(0, 2, 1, 4, 3).reshape(n, num_kv_heads, -1, head_size)
        value[start:start + n].copy_(v[:, :, :seq_len])
        del v
    return key, value


class CachePool:
    """One (dtype, heads) group's paged K/V cache, big enough for the group's largest row, random data."""

    def __init__(self, torch_dtype, num_kv_heads, num_blocks, device, generator):
        import torch

        x = 16 // torch.tensor([], dtype=torch_dtype).element_size()
        self.num_blocks = num_blocks
        self.key = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE // x, BLOCK_SIZE, x, dtype=torch_dtype,
                               device=device, generator=generator)
        self.value = torch.randn(num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE, dtype=torch_dtype, device=device,
                                 generator=generator)

    def contiguous(self, block_tables, seq_len):
        """K and V as [num_seqs, num_kv_heads, seq_len, head_size] (``contiguous_kv``)."""
        return contiguous_kv(self.key, self.value, block_tables, seq_len)

    def reference(self, query, block_tables, seq_len, scale, num_seqs):
        """Float32 attention for the first ``num_seqs`` sequences, read token by token from the cache."""
        import torch

        outputs = []
        tokens = torch.arange(seq_len, device=query.device)
        for seq in range(num_seqs):
            blocks = block_tables[seq].long()[tokens // BLOCK_SIZE]
            offsets = tokens % BLOCK_SIZE
            keys = self.key[blocks, :, :, offsets, :].reshape(seq_len, -1, HEAD_SIZE).float()  # [L, kv, D]
            values = self.value[blocks, :, :, offsets].float()  # [L, kv, D]
            num_kv_heads = keys.shape[1]
            q = query[seq].float().view(num_kv_heads, -1, HEAD_SIZE)  # [kv, group, D]
            logits = torch.einsum("hgd,lhd->hgl", q, keys) * scale
            outputs.append(torch.einsum("hgl,lhd->hgd", logits.softmax(-1), values).reshape(-1, HEAD_SIZE))
        return torch.stack(outputs)


@functools.lru_cache(maxsize=None)
def sdpa_supports_gqa():
    """Whether this torch's scaled_dot_product_attention takes enable_gqa (2.5+)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, 4, 1, 8)
    kv = torch.randn(1, 2, 3, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def decode_sdpa(query, key, value, scale, gqa):
    """SDPA over one decode query per sequence: ``query`` [seqs, heads, head_size] against contiguous ``key`` /
    ``value`` [seqs, kv_heads, tokens, head_size]. Returns (a call, how grouped-query heads were passed); the
    call's output reshapes to ``query``'s shape. Without ``gqa`` (enable_gqa, torch 2.5+) a KV head's query heads
    go in as that many queries of one sequence: the same attention (there is no mask), K/V still read once."""
    import torch.nn.functional as F

    seqs, heads, head_size = query.shape
    kv_heads = key.shape[1]
    if heads == kv_heads:
        q, extra, how = query.unsqueeze(2), {}, "none needed"
    elif gqa:
        q, extra, how = query.unsqueeze(2), {"enable_gqa": True}, "enable_gqa"
    else:
        q, extra, how = query.reshape(seqs, kv_heads, heads // kv_heads, head_size), {}, "grouped queries"
    return (lambda: F.scaled_dot_product_attention(q, key, value, scale=scale, **extra)), how


def errors(out, ref):
    """(relative L2 error, max abs error) of ``out`` against ``ref``; NaN anywhere gives inf."""
    out, ref = out.float(), ref.float()
    if not bool(out.isfinite().all()):
        return math.inf, math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30)), float((out - ref).abs().max())


# ----------------------------------------------------------------------------------------------- a row


class RowRunner:
    def __init__(self, args, device, series, use_sdpa, gqa, warmup_ms, rep_ms, copy_gbps):
        self.args = args
        self.device = device
        self.series = series
        self.use_sdpa = use_sdpa
        self.gqa = gqa
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.copy_gbps = copy_gbps

    def _metrics(self, row, us):
        gbps = row["kv_bytes"] / us / 1e3
        return {"us": us, "gbps": gbps, "pct_copy": 100.0 * gbps / self.copy_gbps if self.copy_gbps else None}

    def _judge(self, result, dtype, out, sdpa_out, reference):
        tolerance = TOLERANCE[dtype]
        result["tolerance"] = tolerance
        flags = []
        if sdpa_out is not None:
            result["rel_err_vs_sdpa"], result["max_abs_err_vs_sdpa"] = errors(out, sdpa_out)
            if not result["rel_err_vs_sdpa"] <= tolerance:
                flags.append(f"rel err vs SDPA {result['rel_err_vs_sdpa']:.2e} > {tolerance:g}")
        result["rel_err_vs_fp32"], result["max_abs_err_vs_fp32"] = errors(out[:reference.shape[0]], reference)
        if not result["rel_err_vs_fp32"] <= tolerance:
            flags.append(f"rel err vs float32 {result['rel_err_vs_fp32']:.2e} > {tolerance:g}")
        result["ok"] = not flags
        if flags:
            result["flag"] = "WRONG: " + "; ".join(flags)

    def _measure(self, row, fn, out, sdpa_out, reference):
        """Check ``fn`` once (poisoned output, peak memory, first-call time), then time it."""
        import torch

        result = {}
        cuda = self.device.type == "cuda"
        try:
            out.fill_(float("nan"))
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
            start = time.perf_counter()
            fn()
            _common.synchronize(self.device)
            result["first_call_s"] = time.perf_counter() - start
            if cuda:
                result["peak_extra_bytes"] = torch.cuda.max_memory_allocated(self.device) - base
            self._judge(result, row["dtype"], out, sdpa_out, reference)
            call_s = result["first_call_s"]
            if call_s > SLOW_CALL_S:  # the first call may have compiled: look again before judging it slow
                start = time.perf_counter()
                fn()
                _common.synchronize(self.device)
                call_s = time.perf_counter() - start
            if call_s > SLOW_CALL_S:
                result["timer"] = f"median of {SLOW_CALL_REPEATS} synchronised calls (call > {SLOW_CALL_S} s)"
                us = _common.few_calls_us(fn, self.device, SLOW_CALL_REPEATS)
            else:
                us = _common.bench_us(fn, self.device, self.warmup_ms, self.rep_ms)
            result.update(self._metrics(row, us))
        except Exception as error:  # noqa: BLE001 - a failing backend is reported for this row, the run goes on
            result = {"failed": _describe(error), "ok": False}
            if cuda:
                torch.cuda.empty_cache()
        return result

    def run(self, row, pool, generator):
        import torch

        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[row["dtype"]]
        num_seqs, seq_len = row["num_seqs"], row["seq_len"]
        num_heads, num_kv_heads = row["num_heads"], row["num_kv_heads"]
        device = self.device
        blocks_per_seq = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        block_tables = torch.randperm(pool.num_blocks, device=device, generator=generator)[
            :num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32)
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        query = torch.randn(num_seqs, num_heads, HEAD_SIZE, dtype=torch_dtype, device=device, generator=generator)
        scale = HEAD_SIZE ** -0.5
        reference = pool.reference(query, block_tables, seq_len, scale, min(num_seqs, REFERENCE_SEQS))
        results, notes = {}, []

        sdpa_out = None
        if self.use_sdpa:
            sdpa_out = self._run_sdpa(row, pool, query, block_tables, scale, reference, results, notes)

        out = torch.empty_like(query)
        partitions = (seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
        exp_sums = torch.empty(num_seqs, num_heads, partitions, dtype=torch.float32, device=device)
        max_logits = torch.empty_like(exp_sums)
        tmp_out = torch.empty(num_seqs, num_heads, partitions, HEAD_SIZE, dtype=torch_dtype, device=device)
        common = (pool.key, pool.value, num_kv_heads, scale, block_tables, seq_lens, BLOCK_SIZE, seq_len, None,
                  "auto", 1.0, 1.0)

        for entry in self.series:
            if entry.backend is None:  # reported once, under the table, not on every row
                results[entry.name] = {"failed": entry.error, "ok": False, "unavailable": True}
                continue
            backend = entry.backend
            calls = {"v1": lambda: backend.paged_attention_v1(out, query, *common),
                     "v2": lambda: backend.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, *common)}
            if entry.kind == "triton":
                for version in ("v1", "v2"):
                    results[f"{entry.name}_{version}"] = self._measure(
                        row, calls[version], out, sdpa_out, reference)
                picked = results[f"{entry.name}_{row['vllm_entry']}"]
                results[entry.name] = dict(picked, entry=row["vllm_entry"])
                timed = [(results[f"{entry.name}_{v}"]["us"], v) for v in ("v1", "v2")
                         if "us" in results[f"{entry.name}_{v}"]]
                if timed:
                    best = min(timed)[1]
                    results[f"{entry.name}_best"] = dict(results[f"{entry.name}_{best}"], entry=best)
            else:
                results[entry.name] = dict(self._measure(row, calls[row["vllm_entry"]], out, sdpa_out, reference), entry=row["vllm_entry"])
        del out, exp_sums, max_logits, tmp_out, block_tables, query
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return results, notes

    def _run_sdpa(self, row, pool, query, block_tables, scale, reference, results, notes):
        import torch

        result = {}
        key = value = None
        try:
            key, value = pool.contiguous(block_tables, row["seq_len"])
            call, result["gqa"] = decode_sdpa(query, key, value, scale, self.gqa)
            sdpa_out = call().reshape(query.shape)
            result["rel_err_vs_fp32"], result["max_abs_err_vs_fp32"] = errors(sdpa_out[:reference.shape[0]],
                                                                              reference)
            result["tolerance"] = TOLERANCE[row["dtype"]]
            result["ok"] = result["rel_err_vs_fp32"] <= result["tolerance"]
            if not result["ok"]:
                result["flag"] = f"WRONG: rel err vs float32 {result['rel_err_vs_fp32']:.2e}"
            result.update(self._metrics(row, _common.bench_us(call, self.device, self.warmup_ms, self.rep_ms)))
        except Exception as error:  # noqa: BLE001
            result, sdpa_out = {"failed": _describe(error), "ok": False}, None
        finally:
            del key, value
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        results["sdpa"] = result
        if sdpa_out is not None and not result["ok"]:
            notes.append("SDPA disagrees with the float32 reference: backends checked against float32 only")
            sdpa_out = None
        return sdpa_out


# ----------------------------------------------------------------------------------------------- run


def launch_overheads(series, device, calls):
    """Host-side microseconds of one v1 call on a tiny input (1 sequence, 64 tokens, heads 32/8, fp16)."""
    import torch

    dtype = torch.float16
    generator = torch.Generator(device=device).manual_seed(1)
    pool = CachePool(dtype, 8, 8, device, generator)
    query = torch.randn(1, 32, HEAD_SIZE, dtype=dtype, device=device, generator=generator)
    out = torch.empty_like(query)
    block_tables = torch.arange(4, dtype=torch.int32, device=device).view(1, 4)
    seq_lens = torch.full((1,), 64, dtype=torch.int32, device=device)
    overheads = {}
    for entry in series:
        if entry.backend is None:
            overheads[entry.name] = {"failed": entry.error}
            continue
        def call(backend=entry.backend):
            backend.paged_attention_v1(out, query, pool.key, pool.value, 8, HEAD_SIZE ** -0.5, block_tables, seq_lens,
                                       BLOCK_SIZE, 64, None, "auto", 1.0, 1.0)
        try:
            overheads[entry.name] = {"us": _common.host_call_us(call, device, calls)}
        except Exception as error:  # noqa: BLE001
            overheads[entry.name] = {"failed": _describe(error)}
    return overheads


def host_references(device, calls):
    """Host cost of two reference calls, timed like the backends' launch overhead: ``torch.add`` on a
    one-element tensor and, on a GPU, a one-argument Triton kernel launched through ``kernel[grid](x)``.
    Host speed differs between machines (the lent H200s' hosts by 1.7x between leases): these say how fast
    this one was."""
    import torch

    x = torch.zeros(1, device=device)
    found = {"torch_add": {"us": _common.host_call_us(lambda: torch.add(x, 1, out=x), device, calls)}}
    if device.type == "cuda":
        try:
            from _host_kernel import add_one as kernel  # benchmarks/ is on sys.path
            found["triton_launch"] = {"us": _common.host_call_us(lambda: kernel[(1,)](x), device, calls)}
        except Exception as error:  # noqa: BLE001
            found["triton_launch"] = {"failed": _describe(error)}
    return found


def group_pools(rows):
    """{(dtype, num_heads, num_kv_heads): blocks needed by the group's largest row}."""
    sizes = {}
    for row in rows:
        key = (row["dtype"], row["num_heads"], row["num_kv_heads"])
        blocks = row["num_seqs"] * ((row["seq_len"] + BLOCK_SIZE - 1) // BLOCK_SIZE)
        sizes[key] = max(sizes.get(key, 0), blocks)
    return sizes


def output_paths(args, device):
    directory = _common.results_dir(args.results_dir, device)
    stem = "paged_attention" + (f"-{args.tag}" if args.tag else "")
    return {suffix: directory / f"{stem}.{suffix}" for suffix in ("json", "md", "png")}


def main(argv=None):
    args = parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {device}: CUDA is not available here (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        sys.exit(f"--device: cuda, cuda:N or cpu; got {device}")

    kernels = import_kernels()
    notes = []
    series = make_series(args, device, kernels, notes)
    use_sdpa = args.backends is None or "sdpa" in args.backends
    gqa = sdpa_supports_gqa()
    if not gqa:
        notes.append("This torch's SDPA has no enable_gqa: a KV head's query heads are passed to it as that many "
                      "queries.")
    rows, skipped = plan_rows(args, device)
    warmup_ms, rep_ms = choose_timing(args, rows, series, use_sdpa, device)
    estimate = estimate_seconds(rows, series, use_sdpa, device, warmup_ms, rep_ms)
    print(f"{len(rows)} rows ({len(skipped)} skipped) on {_common.device_name(device)}; series: "
          f"{', '.join(s.name + ('' if s.backend else ' (unavailable)') for s in series)}"
          f"{', sdpa' if use_sdpa else ''}; do_bench warmup {warmup_ms:.0f} ms, rep {rep_ms:.0f} ms; "
          f"estimated {estimate / 60:.1f} min", flush=True)
    for entry in series:
        if entry.error:
            print(f"  {entry.name}: unavailable: {entry.error}", flush=True)
    for row in skipped:
        print(f"  skip {_row_label(row)}: {row['reason']}", flush=True)
    if args.dry_run:
        for row in rows:
            print(f"  {_row_label(row)}  K+V {row['kv_bytes'] / 1e6:.1f} MB  vLLM picks {row['vllm_entry']}")
        return 0

    paths = output_paths(args, device)
    started = time.perf_counter()
    copy_bytes = int((args.copy_gib if args.copy_gib is not None else (4 if device.type == "cuda" else 1 / 16))
                     * (1 << 30))
    ceiling = {"start": _common.copy_ceiling(device, copy_bytes, warmup_ms, rep_ms)}
    payload = {
        "benchmark": "paged_attention_decode",
        "environment": _common.environment(device),
        "config": {"head_size": HEAD_SIZE, "block_size": BLOCK_SIZE, "partition_size": PARTITION_SIZE,
                   "grid": {"dtypes": args.dtypes, "heads": args.heads, "num_seqs": args.num_seqs,
                            "seq_lens": args.seq_lens, "max_kv_gb": args.max_kv_gb},
                   "shared_memory_limit": args.shared_memory_limit, "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                   "timer": "triton.testing.do_bench median, L2 flushed" if device.type == "cuda"
                   else "CPU clock median", "seed": args.seed,
                   "bytes_counted": "K+V bytes read once (query, output, block tables not counted)",
                   "copy_counted": "bytes read + bytes written", "tolerance_rel_l2": TOLERANCE},
        "series": {s.name: {"available": s.backend is not None, "error": s.error, "note": s.note} for s in series},
        "copy_ceiling": ceiling, "copy_gbps": ceiling["start"]["gbps"],
        "launch_overhead_us": None, "host_reference_us": None, "rows": [], "skipped": skipped, "notes": notes,
        "complete": False,
    }
    launch_calls = args.launch_calls or (1000 if device.type == "cuda" else 100)
    payload["launch_overhead_us"] = launch_overheads(series, device, launch_calls)
    payload["host_reference_us"] = host_references(device, launch_calls)
    _common.write_json(paths["json"], payload)

    runner = RowRunner(args, device, series, use_sdpa, gqa, warmup_ms, rep_ms, ceiling["start"]["gbps"])
    progress = _common.Progress(len(rows), "paged attention")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    pool_blocks = group_pools(rows)
    pool, pool_key, pool_error = None, None, None
    live_problems = 0
    try:
        for row in rows:
            key = (row["dtype"], row["num_heads"], row["num_kv_heads"])
            if key != pool_key:
                pool, pool_error, pool_key = None, None, key
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[row["dtype"]]
                try:
                    pool = CachePool(torch_dtype, row["num_kv_heads"], pool_blocks[key], device, generator)
                except Exception as error:  # noqa: BLE001 - e.g. out of memory: the group's rows say so
                    pool_error = f"cache pool of {pool_blocks[key]} blocks not allocated: {_describe(error)}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            row_started = time.perf_counter()
            if pool is None:
                row["results"], row["notes"] = {}, [pool_error]
            else:
                row["results"], row["notes"] = runner.run(row, pool, generator)
            row["wall_s"] = time.perf_counter() - row_started
            payload["rows"].append(row)
            _common.write_json(paths["json"], payload)
            progress.step(_row_label(row))
            for problem in _row_problems(row):
                live_problems += 1
                if live_problems <= MAX_PRINTED_PROBLEMS:
                    progress.write(f"{_row_label(row)}: {problem}")
    finally:
        progress.close()
        pool = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if payload["rows"]:
            try:  # a drifting clock or a throttled card shows here
                ceiling["end"] = _common.copy_ceiling(device, copy_bytes, warmup_ms, rep_ms)
            except Exception as error:  # noqa: BLE001 - the files below must still be written
                notes.append(f"copy ceiling at the end not measured: {_describe(error)}")
        payload["complete"] = len(payload["rows"]) == len(rows)
        payload["wall_s"] = time.perf_counter() - started
        payload["targets"] = check_targets(payload)
        _common.write_json(paths["json"], payload)
        paths["md"].write_text(render_markdown(payload))
        render_plot(payload, paths["png"])
    print_summary(payload, paths)
    return 0


# ----------------------------------------------------------------------------------------------- reports


def _row_label(row):
    return f"{row['dtype']} {row['num_heads']}x{row['num_kv_heads']} {row['num_seqs']}x{row['seq_len']}"


def _row_problems(row):
    problems = []
    for name, result in row["results"].items():
        if name.endswith("_best") or (name + "_v1") in row["results"]:
            continue  # derived series repeat their entry point's result
        if result.get("unavailable"):
            continue
        if "failed" in result:
            problems.append(f"{name} failed: {result['failed']}")
        elif result.get("flag"):
            problems.append(f"{name} {result['flag']}")
    return problems + row.get("notes", [])


def _series_columns(payload):
    """Column order for the table and the plot: Triton series, torch, SDPA."""
    names = []
    for name, info in payload["series"].items():
        if name.startswith("triton"):
            names += [f"{name}_v1", f"{name}_v2", name, f"{name}_best"]
        else:
            names.append(name)
    if any("sdpa" in row["results"] for row in payload["rows"]):
        names.append("sdpa")
    return names


def _cell(result):
    if result is None:
        return None
    if "failed" in result:
        return "failed"
    text = f"{result['us']:.1f} ({result['pct_copy']:.0f}%)" if result.get("pct_copy") is not None \
        else f"{result['us']:.1f}"
    if result.get("entry"):  # the derived series say which entry point they are
        text += f" {result['entry']}"
    if result.get("flag"):
        text += " **WRONG**"
    return text


_HOST_REFERENCE_NAMES = {"torch_add": "torch.add on a 1-element tensor",
                         "triton_launch": "a 1-argument Triton kernel through kernel[grid](x)"}


def _host_times(entries, names=None):
    """``{name: {"us": ...} | {"failed": ...}}`` as "name 12.3 us, other failed" (``names`` relabels)."""
    names = names or {}
    return ", ".join(f"{names.get(name, name)} {value['us']:.1f} us" if "us" in value else f"{name} failed"
                     for name, value in (entries or {}).items())


def render_markdown(payload):
    env = payload["environment"]
    ceiling = payload["copy_ceiling"]
    lines = [f"# Paged-attention decode on {env['gpu']}", "",
             f"{env['date']} · torch {env['torch']} · triton {env['triton']} · commit {env.get('git_commit')} · "
             f"{payload['config']['timer']} (warmup {payload['config']['warmup_ms']:.0f} ms, "
             f"rep {payload['config']['rep_ms']:.0f} ms)", "",
             f"Head size {HEAD_SIZE}, block size {BLOCK_SIZE}, random block tables. Cells: median us "
             f"(% of copy). GB/s counts {payload['config']['bytes_counted']}.",
             f"Copy ceiling ({ceiling['start']['bytes_copied'] / (1 << 30):.2f} GiB device copy, "
             f"{payload['config']['copy_counted']}): {ceiling['start']['gbps']:.0f} GB/s at the start"
             + (f", {ceiling['end']['gbps']:.0f} GB/s at the end" if "end" in ceiling else "") + ".", ""]
    lines.append("Host-side launch overhead of one v1 call (1 x 64 tokens, heads 32/8, fp16; CPU clock, no wait): "
                 + _host_times(payload["launch_overhead_us"]) + ".")
    if payload.get("host_reference_us"):
        lines.append("Host speed of this machine, timed the same way: "
                     + _host_times(payload["host_reference_us"], _HOST_REFERENCE_NAMES) + ".")
    lines.append("")
    names = _series_columns(payload)
    header = ["dtype", "heads q/kv", "seqs x tokens", "K+V MB", "vLLM picks"] + names + ["torch peak extra MB",
                                                                                        "check"]
    table, problem_lines = [], []
    for row in payload["rows"]:
        results = row["results"]
        torch_peak = results.get("torch", {}).get("peak_extra_bytes")
        problems = _row_problems(row)
        table.append([row["dtype"], f"{row['num_heads']}/{row['num_kv_heads']}",
                      f"{row['num_seqs']} x {row['seq_len']}", f"{row['kv_bytes'] / 1e6:.1f}", row["vllm_entry"]]
                     + [_cell(results.get(name)) for name in names]
                     + [None if torch_peak is None else f"{torch_peak / 1e6:.1f}",
                        "ok" if not problems else f"{len(problems)} problem(s), below"])
        problem_lines += [f"- {_row_label(row)}: {problem}".replace("|", "/") for problem in problems]
    lines += [_common.markdown_table(header, table), ""]
    if payload.get("targets"):
        lines += ["Issue 7's targets (Triton: vLLM's pick of entry point; a WRONG or failed row misses):", ""]
        lines += [f"- {c['target']} [{c['series']}]: {c['met']}/{c['rows']} met"
                  + (f"; missed: {', '.join(c['missed'])}" if c["missed"] else "") for c in payload["targets"]]
        lines.append("")
    if problem_lines:
        lines += ["Problems (a WRONG series is still timed; its numbers stay in the table, marked):", ""]
        lines += problem_lines + [""]
    for name, info in payload["series"].items():
        if info.get("error"):
            lines.append(f"- {name} unavailable: {info['error']}")
        if info.get("note"):
            lines.append(f"- {name}: {info['note']}")
    lines += [f"- skipped {_row_label(row)}: {row['reason']}" for row in payload["skipped"]]
    lines += [f"- {note}" for note in payload["notes"]]
    if not payload["complete"]:
        lines.append(f"- INCOMPLETE: {len(payload['rows'])} rows measured before the run stopped.")
    return "\n".join(lines) + "\n"


def render_plot(payload, path):
    if not payload["rows"]:
        return
    plotted = list(payload["series"]) + ["sdpa"]
    wrong = {name: sum(1 for row in payload["rows"] if row["results"].get(name, {}).get("flag")) for name in plotted}
    labels = {name: name + (" (vLLM's pick)" if name.startswith("triton") else "")
              + (f" WRONG on {wrong[name]} rows" if wrong[name] else "") for name in plotted}
    panels = {}
    for row in payload["rows"]:
        title = f"{row['dtype']}, heads {row['num_heads']}/{row['num_kv_heads']}"
        panel = panels.setdefault(title, {labels[name]: [] for name in plotted})
        for name in plotted:
            result = row["results"].get(name)
            if result and "gbps" in result:
                panel[labels[name]].append((row["kv_bytes"] / 1e6, result["gbps"]))
    env = payload["environment"]
    _common.plot_panels(path, panels, payload["copy_gbps"], "K+V MB (read once)", "GB/s (K+V bytes / time)",
                        f"Paged-attention decode, head {HEAD_SIZE}, block {BLOCK_SIZE} — {env['gpu']}, "
                        f"torch {env['torch']}, triton {env['triton']}",
                        f"device copy {payload['copy_gbps']:.0f} GB/s")


# Issue 7's targets: (what, series, which rows, the value compared, the bound).
TARGETS = (
    (">= 85% of copy, K+V >= 256 MiB", "triton", lambda row: row["kv_bytes"] >= 256 << 20, "pct_copy", 85.0),
    (">= 60% of copy at 1 x 32768", "triton", lambda row: (row["num_seqs"], row["seq_len"]) == (1, 32768),
     "pct_copy", 60.0),
    ("no slower than SDPA, K+V < 64 MiB", "triton", lambda row: row["kv_bytes"] < 64 << 20, "vs_sdpa", None),
    (">= 80% of copy, K+V >= 256 MiB, shared-memory limit", "triton_smem", lambda row: row["kv_bytes"] >= 256 << 20,
     "pct_copy", 80.0),
    (">= 25% of copy, K+V >= 1 GiB", "torch", lambda row: row["kv_bytes"] >= 1 << 30, "pct_copy", 25.0),
)
LAUNCH_TARGET_US = 15.0


def check_targets(payload):
    """Each target of issue 7 against the measured rows (vLLM's pick of entry point; WRONG rows miss)."""
    checks = []
    for what, series_prefix, selects, measure, bound in TARGETS:
        if series_prefix == "triton_smem":
            names = [n for n in payload["series"] if n.startswith("triton_smem")]
        else:
            names = [series_prefix] if series_prefix in payload["series"] else []
        for name in names:
            checked, missed = 0, []
            for row in payload["rows"]:
                result = row["results"].get(name)
                if not selects(row) or result is None:
                    continue
                checked += 1
                if "failed" in result or result.get("flag"):
                    missed.append(f"{_row_label(row)} " + ("failed" if "failed" in result else "WRONG"))
                elif measure == "vs_sdpa":
                    sdpa = row["results"].get("sdpa", {})
                    if "us" in sdpa and result["us"] > sdpa["us"]:
                        missed.append(f"{_row_label(row)} {result['us']:.1f} us vs SDPA {sdpa['us']:.1f} us")
                elif result[measure] < bound:
                    missed.append(f"{_row_label(row)} {result[measure]:.1f}%")
            if checked:
                checks.append({"target": what, "series": name, "rows": checked, "met": checked - len(missed),
                               "missed": missed})
    for name, value in (payload["launch_overhead_us"] or {}).items():
        if name.startswith("triton") and "us" in value:
            checks.append({"target": f"host launch overhead of a v1 call <= {LAUNCH_TARGET_US:g} us",
                           "series": name, "rows": 1, "met": int(value["us"] <= LAUNCH_TARGET_US),
                           "missed": [] if value["us"] <= LAUNCH_TARGET_US else [f"{value['us']:.1f} us"]})
    return checks


def print_summary(payload, paths):
    print(f"copy ceiling {payload['copy_gbps']:.0f} GB/s; launch overhead (v1, tiny): "
          + _host_times(payload["launch_overhead_us"]) + "; host references: "
          + _host_times(payload.get("host_reference_us")))
    shown = [n for n in payload["series"] if not n.endswith(("_v1", "_v2"))]
    shown = [n for name in shown for n in ((name, name + "_best") if name.startswith("triton") else (name,))]
    shown.append("sdpa")
    widths = [max(9, len(name) + 2) for name in shown]
    print("row".ljust(26) + "K+V MB".rjust(9) + "".join(n.rjust(w) for n, w in zip(shown, widths))
          + "  (% of copy)")
    for row in payload["rows"]:
        cells = []
        for name in shown:
            result = row["results"].get(name)
            if result is None:
                cells.append("-")
            elif "failed" in result:
                cells.append("failed")
            else:
                cells.append(f"{result['pct_copy']:.1f}%" + ("!" if result.get("flag") else ""))
        print(_row_label(row).ljust(26) + f"{row['kv_bytes'] / 1e6:9.1f}"
              + "".join(c.rjust(w) for c, w in zip(cells, widths)))
    problems = [(row, p) for row in payload["rows"] for p in _row_problems(row)]
    for row, problem in problems[:MAX_PRINTED_PROBLEMS]:
        print(f"PROBLEM {_row_label(row)}: {problem}")
    if len(problems) > MAX_PRINTED_PROBLEMS:
        print(f"... {len(problems) - MAX_PRINTED_PROBLEMS} more problems in {paths['md'].name}")
    for check in payload["targets"]:
        missed = check["missed"]
        print(f"TARGET {check['target']} [{check['series']}]: {check['met']}/{check['rows']} met"
              + (f"; missed: {', '.join(missed[:6])}{' ...' if len(missed) > 6 else ''}" if missed else ""))
    print(f"{len(payload['rows'])} rows in {payload['wall_s']:.0f} s; {len(problems)} problems ('!' = WRONG); "
          f"wrote {paths['json']}, {paths['md'].name}, {paths['png'].name}")


if __name__ == "__main__":
    sys.exit(main())
