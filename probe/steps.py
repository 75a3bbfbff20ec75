"""The ladder's steps 2-5 and the device reading, run only in the probe's child process.

Each step takes the child's context (``device``: what ``detect_device`` read, ``results``: the
details of earlier steps) and returns its details, or raises: the exception's text is recorded.
"""

import functools
import math
import os
import statistics
import time
from concurrent.futures.process import BrokenProcessPool

import torch

from biv100_patch.kernels import contract, get_backend, limits as kernel_limits
from biv100_patch.kernels.variants import map_each_in_own_process, map_in_processes

from . import detect

# Triton vs PyTorch backend, |triton - torch| <= atol + rtol * |torch| (the kernels' contract;
# bfloat16 from the golden table, where vLLM itself sits near 1.2e-2 of an fp64 reference).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 1.6e-2)}
# The kernels contract's fp8 tolerance (vLLM's own fp8 tests use atol 1e-2).
FP8_ATOL = 1e-2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TRIVIAL_SIZE = 1000
BENCH_SHAPES = (
    # A 7B-class model's decode: 32 query heads over 8 kv heads, head 128, 16-token blocks.
    {"name": "decode-v1", "kernel": "v1", "num_seqs": 32, "seq_len": 1024},
    {"name": "decode-v2", "kernel": "v2", "num_seqs": 4, "seq_len": 4096},
)
BENCH_HEADS, BENCH_KV_HEADS, BENCH_HEAD_SIZE, BENCH_BLOCK = 32, 8, 128, 16
BENCH_WARMUP, BENCH_REPEATS = 3, 20


class StepFailure(RuntimeError):
    """A step's finding, with the details that explain it kept for the record."""

    def __init__(self, message, details):
        super().__init__(message)
        self.details = details


def _device(context):
    index = context["device"].get("index")
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def detect_device(context):
    """The device's properties (torch, then Triton's driver); the CPU under Triton's interpreter."""
    index = context["device_index"]
    if not torch.cuda.is_available():
        return {"index": None, "name": "cpu", "capability": None, "multiprocessor_count": None,
                "total_memory": None, "uuid": None, "warp_size": None, "shared_memory_per_block": None,
                "sources": {}}
    torch.cuda.set_device(index)
    return detect.device_properties(torch, index, detect.triton_device_properties(index))


def device_limits(context):
    """The kernels' DeviceLimits for the probed device (read the same way the kernels read them)."""
    device = _device(context)
    if device.type == "cpu":
        return None
    return kernel_limits.DeviceLimits.from_torch_device(device)


def trivial_kernel(context):
    """Compile ``out = 2 * x + y`` and check every element, exactly (float32)."""
    from . import _trivial_kernel

    device = _device(context)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TRIVIAL_SIZE, generator=generator).to(device)
    y = torch.randn(TRIVIAL_SIZE, generator=generator).to(device)
    start = time.perf_counter()
    out = _trivial_kernel.scaled_add(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    expected = 2 * x + y
    wrong = int((out != expected).sum())
    details = {"elements": TRIVIAL_SIZE, "first_call_seconds": round(seconds, 3), "wrong_elements": wrong}
    if wrong:
        raise StepFailure(f"{wrong} of {TRIVIAL_SIZE} elements of 2*x+y are wrong", details)
    return details


def make_paged_case(*, kernel, head_size, block_size, dtype, kv_cache_dtype="auto", device="cpu",
                    num_seqs=2, num_heads=4, num_kv_heads=2, seq_lens=None, seed=0):
    """Inputs of one decode call in vLLM's layouts, blocks scattered over a shuffled pool.

    The v2 case spans two 512-token partitions; the v1 case is long enough (half a partition) for the Triton
    backend to split it over programs and reduce the splits in the same launch; the last block of each
    sequence is partly used.
    """
    generator = torch.Generator().manual_seed(seed)
    if seq_lens is None:
        if kernel == "v2":
            seq_lens = [contract.PARTITION_SIZE + block_size + 3, 5]
        else:
            seq_lens = [contract.PARTITION_SIZE // 2 + block_size + 5, 1]
        seq_lens = (seq_lens * num_seqs)[:num_seqs]
    fp8 = kv_cache_dtype != "auto"
    x = 16 if fp8 else 16 // torch.empty((), dtype=dtype).element_size()
    blocks_per_seq = [math.ceil(length / block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    width = max(blocks_per_seq)
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = pool[used:used + count]
        used += count
    key = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x, generator=generator)
    value = torch.randn(num_blocks, num_kv_heads, head_size, block_size, generator=generator)
    scale_k = scale_v = 1.0
    if fp8:
        scale_k = scale_v = 0.02
        fp8_type = torch.float8_e4m3fn if kv_cache_dtype in ("fp8", "fp8_e4m3") else torch.float8_e5m2
        key = (key / scale_k).clamp(-448, 448).to(fp8_type).view(torch.uint8)
        value = (value / scale_v).clamp(-448, 448).to(fp8_type).view(torch.uint8)
    else:
        key, value = key.to(dtype), value.to(dtype)
    query = (1.5 * torch.randn(num_seqs, num_heads, head_size, generator=generator)).to(dtype)
    max_seq_len = max(seq_lens)
    case = {
        "query": query.to(device), "key_cache": key.to(device), "value_cache": value.to(device),
        "num_kv_heads": num_kv_heads, "scale": head_size ** -0.5, "block_tables": block_tables.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(device), "block_size": block_size,
        "max_seq_len": max_seq_len, "alibi_slopes": None, "kv_cache_dtype": kv_cache_dtype,
        "k_scale": scale_k, "v_scale": scale_v,
    }
    return case


def run_backend(backend, kernel, case):
    """Call ``backend``'s v1 or v2 op on ``case`` and return ``out``."""
    query = case["query"]
    out = torch.empty_like(query)
    arguments = dict(case)
    if kernel == "v2":
        partitions = math.ceil(case["max_seq_len"] / contract.PARTITION_SIZE)
        num_seqs, num_heads, head_size = query.shape
        float_options = {"dtype": torch.float32, "device": query.device}
        backend.paged_attention_v2(out, torch.empty(num_seqs, num_heads, partitions, **float_options),
                                   torch.empty(num_seqs, num_heads, partitions, **float_options),
                                   torch.empty(num_seqs, num_heads, partitions, head_size, dtype=query.dtype,
                                               device=query.device), **arguments)
    else:
        backend.paged_attention_v1(out, **arguments)
    return out


# Step 3 runs every compiled attention binary for the default cache format, and the fp8 formats for
# one head and block size per query dtype; the shapes it does not run are checked at their first
# call by the patcher's runtime fallback.
FP8_PROBE_HEAD_SIZE, FP8_PROBE_BLOCK_SIZE = 128, 16
V1_PROBE_HEAD_SIZE, V1_PROBE_BLOCK_SIZE = 128, 16
# A one-sequence v1 call this many tokens past the longest row that v1 caps at a fused combine's splits: its
# splits (16 or more on a BI-V100, an H200 or the interpreter's limits) go through v1's reduce kernel.
V1_REDUCE_PROBE_EXTRA_TOKENS = 37


def _v2_batch_without_subsplits(limits, block_n):
    """The fewest sequences (a power of 2) for which the v2 case keeps vLLM's partitions whole: the attention
    writes ``tmp_out`` itself and ``_reduce_kernel`` combines it, as in a large decode batch (smaller grids cut
    the partitions into sub-splits, which another kernel combines)."""
    from biv100_patch.kernels import configs

    seqs = 2
    while configs.choose_subsplits(limits, seqs, 2, contract.PARTITION_SIZE, block_n) > 1:
        seqs *= 2
    return seqs


def _kernel_variants(context):
    """The variants step 3 runs: one per distinct compiled attention kernel (see above), each as a
    v2 call (attention + reduce), plus a v1 call per query dtype and cache format (its splits combined in
    the attention launch) and, for the default format, per query dtype: a long one-sequence v1 call (through
    the reduce kernel) and a v2 call of as many sequences as keep its partitions whole."""
    from biv100_patch.kernels import configs, variants

    limits = device_limits(context) or configs.INTERPRETER_LIMITS
    reduce_tokens = configs.FUSED_REDUCE_MAX_TILE_SPLITS * configs.FUSED_CAP_MAX_TOKENS + V1_REDUCE_PROBE_EXTRA_TOKENS
    chosen, seen, v1_done = [], set(), set()
    for variant in variants.variant_list(limits):
        if variant.kernel != "attention":
            continue
        key = variant.compile_key()
        if key in seen:
            continue
        if variant.kv_cache_dtype != "auto" and (variant.head_size, variant.block_size) != (
                FP8_PROBE_HEAD_SIZE, FP8_PROBE_BLOCK_SIZE):
            continue
        group = next((group for group in variants.GROUP_CLASSES
                      if configs.choose_config(limits, variant.head_size, variant.block_size, DTYPES[variant.dtype],
                                               variant.kv_cache_dtype, group) == variant.config), None)
        if group is None:
            continue
        seen.add(key)
        entry = {"kernel": "v2", "head_size": variant.head_size, "block_size": variant.block_size,
                 "dtype": variant.dtype, "kv_cache_dtype": variant.kv_cache_dtype, "num_heads": group,
                 "num_kv_heads": 1, "variant_key": list(key)}
        chosen.append(entry)
        v1_key = (variant.dtype, variant.kv_cache_dtype)
        if (configs._next_power_of_2(variant.head_size), variant.block_size) == (
                V1_PROBE_HEAD_SIZE, V1_PROBE_BLOCK_SIZE) and v1_key not in v1_done:
            v1_done.add(v1_key)
            chosen.append(dict(entry, kernel="v1"))
            if variant.kv_cache_dtype == "auto":
                chosen.append(dict(entry, kernel="v1", seq_lens=[reduce_tokens]))
                chosen.append(dict(entry, num_seqs=_v2_batch_without_subsplits(limits, variant.config.block_n)))
    return chosen


def variant_case(variant, device="cpu"):
    """The paged case step 3 runs for one of ``_kernel_variants``' entries (its ``seq_lens`` or ``num_seqs``
    where it names them, else ``make_paged_case``'s two sequences)."""
    seq_lens = variant.get("seq_lens")
    return make_paged_case(kernel=variant["kernel"], head_size=variant["head_size"],
                           block_size=variant["block_size"], dtype=DTYPES[variant["dtype"]],
                           kv_cache_dtype=variant["kv_cache_dtype"], device=device,
                           num_heads=variant.get("num_heads", 4), num_kv_heads=variant.get("num_kv_heads", 2),
                           num_seqs=len(seq_lens) if seq_lens else variant.get("num_seqs", 2), seq_lens=seq_lens)


def _compare_variant(triton_backend, torch_backend, device, variant):
    """One variant's call on both backends; the entry for the record, with ``ok`` and any error."""
    dtype = DTYPES[variant["dtype"]]
    entry = dict(variant)
    case = variant_case(variant, device)
    try:
        expected = run_backend(torch_backend, variant["kernel"], case).float()
        got = run_backend(triton_backend, variant["kernel"], case).float()
        # The second call of a shape takes the launcher's direct path, not Triton's JIT: it must agree.
        again = run_backend(triton_backend, variant["kernel"], case).float()
    except Exception as error:
        entry["ok"] = False
        entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        return entry
    if not torch.equal(got.nan_to_num(), again.nan_to_num()):
        entry["ok"] = False
        entry["error"] = f"a repeated call differs from the first by {(got - again).abs().max().item():.3g}"
        return entry
    atol, rtol = TOLERANCES[dtype]
    if variant["kv_cache_dtype"] != "auto":
        atol = max(atol, FP8_ATOL)
    excess = ((got - expected).abs() - rtol * expected.abs()).max().item()
    entry["max_abs_diff"] = (got - expected).abs().max().item()
    entry["ok"] = bool(torch.isfinite(got).all()) and excess <= atol
    if not entry["ok"]:
        entry["error"] = f"differs from the PyTorch backend by {entry['max_abs_diff']:.3g} (atol {atol:g})"
    return entry


def _compare_variants_on(device_index, variants_to_run):
    """Worker-process entry: compare ``variants_to_run`` on CUDA device ``device_index``."""
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    triton_backend = get_backend("triton", limits=kernel_limits.DeviceLimits.from_torch_device(device))
    torch_backend = get_backend("torch")
    entries = [_compare_variant(triton_backend, torch_backend, device, variant) for variant in variants_to_run]
    return entries, compiled_binaries()


# Compiling is what step 3 spends its time on (dozens of kernels, seconds each), so on a GPU the
# variants are shared out over worker processes that compile side by side.
MAX_COMPILE_WORKERS = 8
PROCESS_DIED = "its process died while compiling or running it (a compiler crash?)"
WORKER_DIED = "a worker process died (a compiler crash?): every variant again, each in a process of its own"


def _compare_in_pool(device_index, to_run, workers, compare=_compare_variants_on, progress=None):
    """``compare`` over ``workers`` processes, one variant per task (a free worker takes the next, and each
    finished variant is told to ``progress(done, total)``): (entries in ``to_run``'s order, compiled
    binaries). Raises ``BrokenProcessPool`` when a worker dies."""
    return _compare_all(functools.partial(map_in_processes, compare, workers=workers), device_index, to_run, progress)


def _compare_isolated(device_index, to_run, workers, compare=_compare_variants_on, progress=None):
    """Each variant in a process of its own, ``workers`` at a time: one whose process dies fails alone."""
    def died(args):
        return [dict(args[1][0], ok=False, error=PROCESS_DIED)], []

    return _compare_all(functools.partial(map_each_in_own_process, compare, workers=workers, died=died),
                        device_index, to_run, progress)


def _compare_all(run, device_index, to_run, progress):
    """(entries in ``to_run``'s order, distinct binaries) of ``run(arguments, on_result=...)`` over one
    ``(device_index, [variant])`` call per variant, counting them off as they end."""
    results = {}

    def on_result(index, result):
        results[index] = result
        if progress is not None:
            progress(len(results), len(to_run))

    run([(device_index, [variant]) for variant in to_run], on_result=on_result)
    entries, binaries = [], set()
    for index in range(len(to_run)):
        found, compiled = results[index]
        entries.extend(found)
        binaries.update(tuple(binary) for binary in compiled)  # a worker lists all it compiled so far
    return entries, [list(binary) for binary in sorted(binaries)]


def variants_match(context):
    """Each variant against the PyTorch backend on a small paged case, within the contract tolerance.

    Passes while at least one variant matches and every failure names its kernel variant: those are listed
    under ``excluded`` (``configs.attention_key`` lists), and the patch routes their calls to the PyTorch
    backend. A worker that dies (a compiler crash takes its process) costs a second round with each variant
    in a process of its own, so the crash is pinned on its variant."""
    device = _device(context)
    to_run = _kernel_variants(context)
    progress = context.get("progress")
    workers = min(MAX_COMPILE_WORKERS, os.cpu_count() or 1, len(to_run))
    if device.type == "cuda" and workers > 1:
        try:
            compared, compiled = _compare_in_pool(device.index, to_run, workers, progress=progress)
        except BrokenProcessPool:
            if progress is not None:
                progress(0, len(to_run), note=WORKER_DIED)
            compared, compiled = _compare_isolated(device.index, to_run, workers, progress=progress)
    else:
        triton_backend = get_backend("triton", limits=device_limits(context))
        torch_backend = get_backend("torch")
        compared = []
        for variant in to_run:
            compared.append(_compare_variant(triton_backend, torch_backend, device, variant))
            if progress is not None:
                progress(len(compared), len(to_run))
        compiled = compiled_binaries()
    failures = [entry for entry in compared if not entry["ok"]]
    # Step 4 measures these: [kernel name, shared bytes] of every binary step 3 compiled.
    details = {"variants": compared, "compared": len(compared), "failed": len(failures), "compiled": compiled}
    if not compared:
        raise StepFailure("the kernels list no variant for this device", details)
    if failures and (len(failures) == len(compared) or not all(entry.get("variant_key") for entry in failures)):
        first = failures[0]
        raise StepFailure(f"{len(failures)} of {len(compared)} variants failed; first: {first['kernel']} "
                          f"head {first['head_size']} block {first['block_size']} {first['dtype']} "
                          f"{first['kv_cache_dtype']}: {first['error']}", details)
    if failures:
        details["excluded"] = [list(key) for key in sorted({tuple(entry["variant_key"]) for entry in failures})]
    return details


def _compiled_kernels(jit_function):
    """The binaries a Triton JIT function compiled in this process (Triton 3.x and 2.x caches)."""
    caches = getattr(jit_function, "device_caches", None)
    if caches:
        for entry in caches.values():
            yield from entry[0].values()
    else:
        for per_device in (getattr(jit_function, "cache", None) or {}).values():
            yield from per_device.values()


def _shared_bytes(kernel):
    metadata = getattr(kernel, "metadata", None)
    shared = getattr(metadata, "shared", None) if metadata is not None else None
    return getattr(kernel, "shared", None) if shared is None else shared


def compiled_binaries():
    """[kernel name, shared bytes] of every paged-attention binary Triton compiled in this process.

    Read from the compiled kernels themselves, whatever backend the vendor's Triton compiles for.
    """
    from triton.runtime.jit import JITFunction

    from biv100_patch.kernels import paged_attention_triton

    binaries = []
    for name, value in sorted(vars(paged_attention_triton).items()):
        if isinstance(value, JITFunction):
            binaries += [[name, _shared_bytes(kernel)] for kernel in _compiled_kernels(value)]
    return binaries


def shared_memory(context):
    """The shared memory of every kernel binary step 3 compiled and ran, against the device's limit."""
    limits = device_limits(context)
    if limits is None:
        return {"skipped": "no device: the interpreter has no shared-memory limit"}
    binaries = context["results"].get("variants_match", {}).get("compiled", [])
    measured = [shared for _, shared in binaries if shared is not None]
    details = {"limit": limits.shared_memory_per_block, "binaries": len(binaries), "measured": len(measured),
               "largest": max(measured, default=0)}
    if not binaries:
        raise StepFailure("no compiled kernel was found to measure (did step 3 run on this device?)", details)
    too_big = [(name, shared) for name, shared in binaries if shared is not None and shared > details["limit"]]
    if too_big:
        details["over_limit"] = [{"kernel": name, "shared_bytes": shared} for name, shared in too_big]
        raise StepFailure(f"{len(too_big)} of {len(binaries)} compiled kernels need more than "
                          f"{details['limit']} bytes of shared memory; largest {details['largest']}", details)
    return details


def _median_seconds(function, device):
    for _ in range(BENCH_WARMUP):
        function()
    times = []
    for _ in range(BENCH_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(context):
    """Median wall time of both backends on representative decode shapes (fp16)."""
    device = _device(context)
    backends = {"triton": get_backend("triton", limits=device_limits(context)), "torch": get_backend("torch")}
    shapes = []
    for shape in BENCH_SHAPES:
        case = make_paged_case(kernel=shape["kernel"], head_size=BENCH_HEAD_SIZE, block_size=BENCH_BLOCK,
                               dtype=torch.float16, device=device, num_seqs=shape["num_seqs"],
                               num_heads=BENCH_HEADS, num_kv_heads=BENCH_KV_HEADS,
                               seq_lens=[shape["seq_len"]] * shape["num_seqs"])
        entry = dict(shape)
        for name, backend in backends.items():
            entry[f"{name}_median_s"] = _median_seconds(lambda: run_backend(backend, shape["kernel"], case), device)
        entry["speedup"] = entry["torch_median_s"] / entry["triton_median_s"]
        shapes.append(entry)
    return {"shapes": shapes, "repeats": BENCH_REPEATS, "warmup": BENCH_WARMUP}
