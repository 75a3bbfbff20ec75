"""Fakes for the probe's tests: a BI-V100 as torch would report it, and ladder steps that pass,
hang, crash or fail to compile. The ``*_step`` and ``fake_detect`` functions run in the probe's
child process (named ``tests.probe_fakes:NAME``); ``passing_ladder`` replaces the whole ladder.
"""

import os
import time
import types

BI_V100 = {"index": 0, "name": "Iluvatar BI-V100", "capability": [7, 0], "multiprocessor_count": 16,
           "total_memory": 34057748480, "uuid": "GPU-fake-bi-v100-0", "warp_size": 64,
           "shared_memory_per_block": 49152, "sources": {"warp_size": "triton driver warpSize"}}


def fake_detect(context):
    return dict(BI_V100, index=context["device_index"])


def passing_step(context):
    return {"checked": True}


def sleeping_step(context):
    time.sleep(120)


def slowly_progressing_step(context):
    for done in range(1, 9):
        time.sleep(0.5)
        context["progress"](done, 8)
        if done == 4:
            context["progress"](0, 8, note="starting over")
    return {"compared": 8}


def crashing_step(context):
    os._exit(7)


def _store_three(x_ptr):
    tl.store(x_ptr + tl.arange(0, 3), 1.0)  # noqa: F821 (``tl`` comes with broken_compile_step's globals)


def broken_compile_step(context):
    """A real Triton compile error: ``tl.arange`` over 3 elements (not a power of two), for 7.0. Triton 3 finds
    it in its front end (CompilationError); 2.x (the BI-V100's 2.3.1, compiled as the AOT check compiles it)
    when its TTIR passes verify the module (RuntimeError: PassManager::run failed). The kernel gets ``tl`` as a
    global: 2.x resolves names there only."""
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(types.FunctionType(_store_three.__code__, {"tl": tl}, "store_three"))
    if int(triton.__version__.split(".")[0]) >= 3:
        from triton.backends.compiler import GPUTarget
        source = triton.compiler.ASTSource(fn=kernel, signature={"x_ptr": "*fp32"}, constexprs={})
        triton.compile(source, target=GPUTarget("cuda", 70, 32))
    else:
        from biv100_patch.kernels import variants
        variants._compile_triton_2(kernel, {"x_ptr": "*fp32"}, {}, {}, (7, 0), "llir")


def passed(number, name, details=None):
    return {"step": number, "name": name, "title": name, "status": "passed", "ok": True, "seconds": 0.01,
            "error": None, "details": details or {}}


def passing_ladder(*, counter=None, delay=0.0, bench=False, **options):
    """The whole ladder, passing, as on a healthy BI-V100; ``counter`` gets a line per probe."""
    if counter:
        with open(counter, "a") as handle:
            handle.write(f"{os.getpid()}\n")
    time.sleep(delay)
    checks = [passed(1, "triton_import", {"version": "2.3.1"}), passed(2, "trivial_kernel"),
              passed(3, "variants_match", {"compared": 12}), passed(4, "shared_memory")]
    if bench:
        checks.append(passed(5, "bench", {"shapes": [{"name": "decode-v1", "triton_median_s": 0.001,
                                                      "torch_median_s": 0.004, "speedup": 4.0}]}))
    return {"device": dict(BI_V100, index=options.get("device_index", 0)), "device_error": None,
            "checks": checks, "triton_version": "2.3.1"}



def compare_or_die(device_index, variants):
    """A step-3 worker (``steps._compare_variants_on``'s signature) that dies on a variant marked ``crash``,
    as a compiler abort takes its process; the others match."""
    if any(variant.get("crash") for variant in variants):
        os._exit(6)
    return ([dict(variant, ok=True) for variant in variants],
            [["_reduce_kernel", 512]] + [["_attention_kernel", 16 * variant["head_size"]] for variant in variants])
