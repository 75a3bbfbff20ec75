"""Sweep of Triton kernel configs on a GPU, behind the choices in kernels/configs.py.

For seven issue-7 rows it times our v1 entry point under every candidate config (tl.dot or float32 broadcast
products, the kernel's own prefetch or Triton's pipeliner, tokens per step, warps, stages), then the three
best again under other split-KV settings. Prints each result and writes ``tune.json`` into ``--results-dir``.
H200 records: benchmarks/results/nvidia-h200/tune.json (the kernel of fe209dd, the candidate list of then) and
sweep.json (the current kernel: hand-picked configs and split settings timed by ``time_config`` below).

    python benchmarks/tune_triton_configs.py --results-dir DIR
"""

import argparse
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

from biv100_patch.kernels import configs, get_backend
from biv100_patch.kernels.limits import DeviceLimits

HEAD_SIZE, BLOCK_SIZE = 128, 16
ROWS = [(torch.float16, 32, 8, 64, 8192), (torch.float16, 32, 8, 1, 32768), (torch.float16, 32, 32, 32, 8192),
        (torch.bfloat16, 64, 8, 64, 8192), (torch.float16, 32, 8, 256, 2048), (torch.float16, 32, 8, 8, 2048),
        (torch.float16, 32, 32, 1, 32768)]
SPLIT_SETTINGS = ((2, 512), (8, 256), (16, 256), (32, 128))  # (programs per SM, min tokens per split)
MOST_TILE_VALUES_PER_THREAD = 256  # broadcast tiles beyond this spill registers


def candidates(group):
    """Configs worth timing for ``group`` query heads per kv head: tl.dot with 1-8 warps, the kernel's own
    prefetch or Triton's pipeliner with 2-5 stages, 16-64 tokens per step; broadcast products likewise."""
    rows = max(configs.MIN_DOT_ROWS, triton.next_power_of_2(group))
    found = [configs.KernelConfig(block_n, rows, warps, stages, True, stages == 1)
             for block_n, warps, stages in ((16, 1, 1), (16, 2, 1), (16, 4, 1), (32, 4, 1), (64, 4, 1),
                                            (16, 1, 2), (16, 1, 3), (16, 1, 4), (16, 2, 3), (16, 2, 5),
                                            (32, 1, 3), (32, 2, 3), (16, 4, 3), (16, 4, 5), (32, 4, 3),
                                            (64, 4, 3), (64, 8, 3))]
    for heads_block in sorted({triton.next_power_of_2(group), 1}):
        for block_n, warps, stages in ((16, 1, 1), (16, 2, 1), (16, 4, 1), (32, 4, 1), (16, 1, 3), (16, 2, 3),
                                       (16, 2, 4), (16, 4, 3), (32, 4, 3), (64, 4, 3), (64, 8, 3)):
            if heads_block * block_n * HEAD_SIZE // (warps * 32) <= MOST_TILE_VALUES_PER_THREAD:
                found.append(configs.KernelConfig(block_n, heads_block, warps, stages, False, stages == 1))
    return found


def make_row(dtype, num_heads, num_kv_heads, num_seqs, seq_len, device):
    blocks = num_seqs * (seq_len // BLOCK_SIZE)
    x = 16 // torch.empty((), dtype=dtype).element_size()
    key_cache = torch.randn(blocks, num_kv_heads, HEAD_SIZE // x, BLOCK_SIZE, x, device=device, dtype=dtype)
    value_cache = torch.randn(blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE, device=device, dtype=dtype)
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs, num_heads, HEAD_SIZE, device=device, dtype=dtype)
    args = (torch.empty_like(query), query, key_cache, value_cache, num_kv_heads, HEAD_SIZE ** -0.5, tables, lens,
            BLOCK_SIZE, seq_len, None, "auto", 1.0, 1.0)
    return args, 2 * key_cache.numel() * key_cache.element_size()


def time_config(config, args, limits, programs_per_sm=configs.PROGRAMS_PER_SM,
                min_tokens=configs.MIN_TOKENS_PER_SPLIT):
    """Median us of one v1 call with ``config`` and the split settings forced (restored afterwards)."""
    saved = configs.choose_config, configs.PROGRAMS_PER_SM, configs.MIN_TOKENS_PER_SPLIT
    configs.choose_config = lambda *_, **__: config
    configs.PROGRAMS_PER_SM, configs.MIN_TOKENS_PER_SPLIT = programs_per_sm, min_tokens
    try:
        backend = get_backend("triton", limits=limits)
        backend.paged_attention_v1(*args)
        torch.cuda.synchronize()
        return do_bench(lambda: backend.paged_attention_v1(*args), rep=30, warmup=5) * 1e3
    finally:
        configs.choose_config, configs.PROGRAMS_PER_SM, configs.MIN_TOKENS_PER_SPLIT = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=os.environ.get("OUT", "."))
    options = parser.parse_args()
    device = torch.device("cuda")
    limits = DeviceLimits.from_torch_device(device)
    source = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_gbps = 2 * source.numel() / (do_bench(lambda: target.copy_(source), rep=200) * 1e-3) / 1e9
    del source, target
    print(f"{limits}, triton {triton.__version__}, torch {torch.__version__}, copy {copy_gbps:.0f} GB/s", flush=True)
    results = {"copy_GBps": copy_gbps, "sweep": []}
    started = time.time()
    for dtype, num_heads, num_kv_heads, num_seqs, seq_len in ROWS:
        args, kv_bytes = make_row(dtype, num_heads, num_kv_heads, num_seqs, seq_len, device)

        def record(config, us, programs_per_sm=configs.PROGRAMS_PER_SM, min_tokens=configs.MIN_TOKENS_PER_SPLIT):
            pct = 100 * kv_bytes / (us * 1e-6) / 1e9 / copy_gbps
            results["sweep"].append(dict(dtype=str(dtype), heads=(num_heads, num_kv_heads), ns=num_seqs, L=seq_len,
                                         cfg=config.__dict__, pps=programs_per_sm, mins=min_tokens, us=us, pct=pct))
            print(f"[{time.time() - started:.0f}s] {str(dtype)[6:]} ({num_heads},{num_kv_heads}) {num_seqs}x{seq_len} "
                  f"{config} pps{programs_per_sm} min{min_tokens}: {us:.1f} us {pct:.1f}%", flush=True)

        timed = []
        for config in candidates(num_heads // num_kv_heads):
            try:
                us = time_config(config, args, limits)
            except Exception as error:  # a config the compiler refuses is reported, the sweep goes on
                print("failed", config, str(error)[:200], flush=True)
                continue
            record(config, us)
            timed.append((us, config))
        for _, config in sorted(timed, key=lambda pair: pair[0])[:3]:
            for programs_per_sm, min_tokens in SPLIT_SETTINGS:
                record(config, time_config(config, args, limits, programs_per_sm, min_tokens), programs_per_sm,
                       min_tokens)
        with open(os.path.join(options.results_dir, "tune.json"), "w") as file:
            json.dump(results, file, indent=1)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
