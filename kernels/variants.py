"""Every kernel variant the Triton backend can launch on a device, and their ahead-of-time compile.

``variant_list(limits)`` enumerates (kernel, head_size, block_size, dtype, kv format, config) for
every head size, block size, query dtype and cache format the contract allows, with the config
``configs.choose_config`` picks under those limits. ``compile_variants(capability, shared_memory_limit)``
compiles each with ``triton.compile(ASTSource, target=GPUTarget("cuda", capability, warp_size))``: no
GPU needed. Each variant is compiled with ALiBi, block sparsity and split outputs switched on (the
superset of its code); head sizes that pad to the same tile share one compiled kernel (the head
size is a runtime argument). Compiles run in fresh processes (``TRITON_INTERPRET`` would turn
``triton.jit`` into the interpreter), ``workers`` at a time. ``through="llir"`` stops each compile once
the kernel is lowered to LLVM IR, where its shared memory is allocated and known: under Triton 3 that skips
LLVM's O3 for NVPTX, PTX and the cubin, all NVIDIA's steps, which a CoreX device replaces with its own
(capability 7.0, 143 kernels on 2 cores: 364 -> 86 s). Triton 2.x runs LLVM's optimizer inside its
lowering, so there only PTX and cubin go.
"""

import concurrent.futures
import dataclasses
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool
import torch

from . import configs, contract
from .limits import DeviceLimits

CACHE_FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2")
# One representative group size per config class (one row; 16, 32, 64 query rows).
GROUP_CLASSES = (1, 8, 32, 64)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Strides Triton specialises to the constant 1 on vLLM's layouts (contiguous innermost dims).
_UNIT_STRIDES = ("stride_o2", "stride_t3", "stride_e2", "stride_m2", "stride_q2", "stride_k4", "stride_v3",
                 "stride_bt1", "stride_st3", "stride_se2", "stride_sm2")


@dataclasses.dataclass(frozen=True)
class Variant:
    """``kernel`` is "attention", "reduce" or "partition"; ``config`` a ``configs.KernelConfig`` (attention),
    ``(subs, parts_block, dims_block, num_warps)`` (partition: v2's sub-split combine and reduce) or
    ``(splits_block, dims_block, num_warps, scratch dtype)`` (reduce).
    Reduce and partition variants have ``block_size`` 0: they do not depend on it."""

    kernel: str
    head_size: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    config: object

    def compile_key(self):
        """What the compiled code depends on: variants with equal keys share one binary (for attention,
        ``configs.attention_key``: the key the probe records for a variant it found wrong)."""
        if self.kernel == "attention":
            return tuple(configs.attention_key(self.head_size, self.block_size, self.dtype, self.kv_cache_dtype,
                                               self.config))
        return (self.kernel, configs._next_power_of_2(self.head_size), False, self.block_size, self.dtype,
                self.kv_cache_dtype, self.config)


def variant_list(limits):
    """Every variant the backend can launch under ``limits`` (a ``DeviceLimits``)."""
    found = []
    for head_size in contract.HEAD_SIZES:
        for dtype in contract.QUERY_DTYPES:
            for block_size in contract.BLOCK_SIZES:
                for kv_cache_dtype in CACHE_FORMATS:
                    picked = []
                    for group in GROUP_CLASSES:
                        config = configs.choose_config(limits, head_size, block_size, dtype, kv_cache_dtype, group)
                        if config not in picked:
                            picked.append(config)
                    found += [Variant("attention", head_size, block_size, _DTYPE_NAMES[dtype], kv_cache_dtype, c)
                              for c in picked]
            # The reduce reads v2's tmp_out (query dtype) or v1's float32 scratch; its tallest and its
            # widest tile.
            tiles = {configs.reduce_tile(1 << 30, head_size), configs.reduce_tile(1, head_size)}
            for scratch in sorted({_DTYPE_NAMES[dtype], "float32"}):
                found += [Variant("reduce", head_size, 0, _DTYPE_NAMES[dtype], "auto",
                                  (splits_block, dims_block, configs.REDUCE_NUM_WARPS, scratch))
                          for splits_block, dims_block in sorted(tiles)]
            # v2's sub-split combine and reduce (writes tmp_out in the query dtype): its most sub-splits and
            # partitions, and its widest tile.
            for subs, partitions in ((configs.MAX_SUBSPLITS, configs.REDUCE_MAX_SPLITS // configs.MAX_SUBSPLITS),
                                     (2, 1)):
                found.append(Variant("partition", head_size, 0, _DTYPE_NAMES[dtype], "auto",
                                     (subs, *configs.partition_reduce_tile(partitions, subs, head_size),
                                      configs.REDUCE_NUM_WARPS)))
    return found


def target_limits(capability, shared_memory_limit, warp_size=32, multiprocessor_count=16):
    return DeviceLimits(shared_memory_per_block=int(shared_memory_limit), multiprocessor_count=multiprocessor_count,
                        warp_size=warp_size, capability=tuple(capability))


COMPILE_STAGES = ("cubin", "llir")


def compile_variants(capability, shared_memory_limit, progress=None, *, warp_size=32, workers=None,
                     variants=None, through="cubin"):
    """Compile every variant for ``capability`` (e.g. (7, 0)) without a GPU, down to ``through`` (a stage of
    ``COMPILE_STAGES``: "cubin" is the whole pipeline).

    Returns one dict per variant: kernel, head_size, block_size, dtype, kv_cache_dtype, config (a dict),
    shared_bytes, ok (compiled and within ``shared_memory_limit``), error (None or the message).
    ``progress(done, total)`` is called after each compile.
    """
    if through not in COMPILE_STAGES:
        raise ValueError(f"through must be one of {', '.join(COMPILE_STAGES)}; got {through!r}")
    capability = tuple(capability)
    if variants is None:
        variants = variant_list(target_limits(capability, shared_memory_limit, warp_size))
    unique = {}
    for variant in variants:
        unique.setdefault(variant.compile_key(), variant)
    workers = workers or max(1, min(os.cpu_count() or 1, len(unique)))
    keys = list(unique)
    arguments = [(unique[key], capability, warp_size, through) for key in keys]
    outcomes = {}

    def record(index, outcome):
        outcomes[keys[index]] = outcome
        if progress is not None:
            progress(len(outcomes), len(unique))

    try:
        map_in_processes(_compile_one, arguments, workers=workers, on_result=record)
    except BrokenProcessPool:
        # A compiler abort takes its worker and the pool (Triton 2.3.1 aborts on some kernels): the rest
        # compile in a process each, so the crash is pinned on its variant.
        left = [index for index, key in enumerate(keys) if key not in outcomes]
        crashed = (None, "the compiler crashed (its process died)")
        map_each_in_own_process(_compile_one, [arguments[index] for index in left], workers=workers,
                                died=lambda args: crashed,
                                on_result=lambda position, outcome: record(left[position], outcome))
    results = []
    for variant in variants:
        shared, error = outcomes[variant.compile_key()]
        if error is None and shared > shared_memory_limit:
            error = f"needs {shared} bytes of shared memory, over the limit of {shared_memory_limit}"
        config = variant.config
        results.append({
            "kernel": variant.kernel, "head_size": variant.head_size, "block_size": variant.block_size,
            "dtype": variant.dtype, "kv_cache_dtype": variant.kv_cache_dtype,
            "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config)
            else {"subs": config[0], "parts_block": config[1], "dims_block": config[2], "num_warps": config[3]}
            if variant.kernel == "partition"
            else {"splits_block": config[0], "dims_block": config[1], "num_warps": config[2],
                  "scratch_dtype": config[3]},
            "shared_bytes": shared, "ok": error is None, "error": error})
    return results


def map_in_processes(function, arguments, *, workers, on_result):
    """``function(*args)`` for each tuple in ``arguments``, in ``workers`` spawned processes, one call per task (a
    free worker takes the next); ``on_result(index, result)`` as each ends. Raises ``BrokenProcessPool`` when a
    worker dies (a compiler abort takes its process); the results told before stand."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(function, *args): index for index, args in enumerate(arguments)}
        for future in concurrent.futures.as_completed(futures):
            on_result(futures[future], future.result())


def map_each_in_own_process(function, arguments, *, workers, died, on_result):
    """``map_in_processes`` with each call in a process of its own, ``workers`` at a time: a call whose process
    dies gives ``died(args)``, so one crash fails one call."""
    with concurrent.futures.ThreadPoolExecutor(workers) as threads:
        futures = {threads.submit(in_own_process, function, *args, died=died(args)): index
                   for index, args in enumerate(arguments)}
        for future in concurrent.futures.as_completed(futures):
            on_result(futures[future], future.result())


def in_own_process(function, *args, died):
    """``function(*args)`` in a spawned process of its own, or ``died`` where that process dies (a compiler
    abort takes the whole process): one crash then fails one item, not a pool's worth."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(function, *args).result()
        except BrokenProcessPool:
            return died


class _LLIRReached(Exception):
    """Raised in place of Triton 3's PTX stage: ``metadata["shared"]`` is set once LLVM IR is made."""

    def __init__(self, shared):
        super().__init__(shared)
        self.shared = shared


def _stop_after_lowering():
    """In this worker process only: skip Triton 3's LLVM O3 (``llvm.optimize_module``) and make its CUDA
    backend raise ``_LLIRReached`` where its PTX stage would start: ``triton.compile`` has no stage to stop at."""
    from triton._C.libtriton import llvm
    from triton.backends.nvidia.compiler import CUDABackend

    def make_ptx(self, src, metadata, *args):
        raise _LLIRReached(metadata["shared"])

    CUDABackend.make_ptx = make_ptx
    llvm.optimize_module = lambda *args, **kwargs: None


def _compile_one(variant, capability, warp_size, through):
    """(shared bytes, None) or (None, error message); runs in a worker process."""
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton
        from triton.compiler import ASTSource

        from . import paged_attention_triton as kernels

        if variant.kernel == "attention":
            fn, constants, options = _attention_source(kernels, variant, warp_size)
        elif variant.kernel == "partition":
            fn, constants, options = _partition_source(kernels, variant)
        else:
            fn, constants, options = _reduce_source(variant)
            fn = kernels._reduce_kernel
        signature, constexprs, attrs = _signature(fn, variant, constants)
        if not configs.triton_3():
            return _compile_triton_2(fn, signature, constexprs, options, capability, through), None
        from triton.backends.compiler import GPUTarget

        if through == "llir":
            _stop_after_lowering()
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", capability[0] * 10 + capability[1], warp_size),
                                      options=options)
        except _LLIRReached as reached:
            return int(reached.shared), None
        return int(compiled.metadata.shared), None
    except Exception as error:  # reported per variant, not raised: the caller wants the whole table
        return None, f"{type(error).__name__}: {error}"[:2000]


def _compile_triton_2(fn, signature, constexprs, options, capability, through):
    """Shared bytes of ``fn`` compiled by Triton 2.x (the BI-V100's 2.3.1) down to ``through`` for ``capability``.

    Its stages run as its ``triton.compile`` runs them, without the last step, the C launcher, which links
    libcuda (absent without a GPU). Arguments are keyed by position, as its JIT keys them: the unit strides
    stay in the signature (as i32) and are also constants equal to 1."""
    from triton.compiler import ASTSource, AttrsDescriptor
    from triton.compiler.backends.cuda import CUDABackend

    position = {name: index for index, name in enumerate(fn.arg_names)}
    types = {position[name]: kind for name, kind in signature.items() if kind != "constexpr"}
    unit = {position[name] for name in _UNIT_STRIDES if name in position}
    types.update({index: "i32" for index in unit})
    constants = {position[name]: value for name, value in constexprs.items()}
    attrs = AttrsDescriptor(divisible_by_16={index for index, kind in types.items() if kind.startswith("*")},
                            equal_to_1=unit, ids_of_folded_args=unit)
    backend = CUDABackend(("cuda", capability[0] * 10 + capability[1]))
    parsed = backend.parse_options(dict(options))
    source = ASTSource(fn, types, constants, attrs)
    stages = {}
    backend.add_stages(stages, parsed)
    metadata = {**parsed.__dict__, **source.metadata()}
    module = source.make_ir(parsed)
    for stage, compile_stage in stages.items():
        module = compile_stage(module, metadata)
        if stage == through:
            break
    return int(metadata["shared"])


def _attention_source(kernels, variant, warp_size):
    config = variant.config
    x = 16 if variant.kv_cache_dtype != "auto" else 16 // {"float32": 4, "float16": 2, "bfloat16": 2}[variant.dtype]
    constants = dict(HEADS_BLOCK=config.heads_block, HEAD_PAD=configs._next_power_of_2(variant.head_size),
                     BLOCK_SIZE=variant.block_size, BLOCK_N=config.block_n, X=x,
                     KV_FORMAT=kernels.FP8_FORMATS[variant.kv_cache_dtype], SCALES_IN_MEMORY=True,
                     HAS_ALIBI=True, IS_SPARSE=True, PARTIAL=True, FUSED_REDUCE=True, CONTIGUOUS_SLOTS=True,
                     USE_DOT=config.use_dot, PREFETCH=config.prefetch,
                     UNMASKED_STEPS=configs.unmasked_steps(config, variant.head_size),
                     KEY_ROWS=configs.key_rows(config, variant.block_size),
                     COMBINE_ROWS=config.heads_block,  # the most registers a group's combine takes
                     COMBINE_SPLITS=configs.combine_tile(config, config.heads_block, variant.head_size,
                                                         warp_size)[1])
    return kernels._attention_kernel, constants, dict(num_warps=config.num_warps, num_stages=config.num_stages)


def _partition_source(kernels, variant):
    subs, parts_block, dims_block, num_warps = variant.config
    constants = dict(SUBS=subs, PARTS_BLOCK=parts_block, DIMS_BLOCK=dims_block)
    return kernels._partition_reduce_kernel, constants, dict(num_warps=num_warps, num_stages=1)


def _reduce_source(variant):
    splits_block, dims_block, num_warps, _ = variant.config
    constants = dict(SPLITS_BLOCK=splits_block, DIMS_BLOCK=dims_block)
    return None, constants, dict(num_warps=num_warps, num_stages=1)


def _signature(fn, variant, constants):
    """Triton types for every argument, as a launch on vLLM's tensors would specialise them."""
    query_type = _TRITON_TYPES[variant.dtype]
    cache_type = "u8" if variant.kv_cache_dtype != "auto" else query_type
    float32_pointers = {"exp_sums_ptr", "max_logits_ptr", "alibi_ptr", "k_scale", "v_scale", "sub_tmp_ptr",
                        "sub_sums_ptr", "sub_max_ptr"}
    signature, constexprs = {}, dict(constants)
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in _UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in float32_pointers:
            signature[name] = "*fp32"
        elif name in ("block_tables_ptr", "seq_lens_ptr", "counters_ptr"):
            signature[name] = "*i32"
        elif name in ("key_ptr", "value_ptr"):
            signature[name] = "*" + cache_type
        elif name == "tmp_ptr" and variant.kernel == "reduce":
            signature[name] = "*" + _TRITON_TYPES[variant.config[3]]
        elif name.endswith("_ptr"):
            signature[name] = "*" + query_type
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    pointers = [i for i, name in enumerate(fn.arg_names) if signature[name].startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}
    return signature, constexprs, attrs
