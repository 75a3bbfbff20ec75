"""Sweep of Triton kernel configs on a GPU (dot / broadcast products, own prefetch / Triton pipeliner, tile,
warps, stages, splits) over six issue-7 rows; prints each and writes tune2.json into $OUT. The H200 run behind
configs.py is benchmarks/results/nvidia-h200/tune.json. Usage: OUT=dir python benchmarks/tune_triton_configs.py"""
import sys, time, json, os

import torch, triton
from triton.testing import do_bench
from biv100_patch.kernels import get_backend, configs
from biv100_patch.kernels.limits import DeviceLimits
KC = configs.KernelConfig
dev = torch.device("cuda")
lim = DeviceLimits.from_torch_device(dev)
print("limits", lim, "triton", triton.__version__, "torch", torch.__version__, flush=True)
src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
COPY = 2 * src.numel() / (do_bench(lambda: dst.copy_(src), rep=200) * 1e-3) / 1e9
print(f"copy {COPY:.0f} GB/s", flush=True); del src, dst
OUT = os.environ.get("OUT", "/tmp")
R = {"copy_GBps": COPY, "sweep": []}
def save(): json.dump(R, open(os.path.join(OUT, "tune2.json"), "w"), indent=1)
def make(dtype, heads, kv, ns, L, bs=16, D=128):
    nb = ns * (L // bs); x = 16 // torch.empty((), dtype=dtype).element_size()
    c = dict(kc=torch.randn(nb, kv, D // x, bs, x, device=dev, dtype=dtype), vc=torch.randn(nb, kv, D, bs, device=dev, dtype=dtype),
             bt=torch.randperm(nb, device=dev, dtype=torch.int32).view(ns, L // bs), sl=torch.full((ns,), L, dtype=torch.int32, device=dev),
             q=torch.randn(ns, heads, D, device=dev, dtype=dtype), kv=kv, L=L, bs=bs)
    c["out"] = torch.empty_like(c["q"]); c["bytes"] = 2 * c["kc"].numel() * c["kc"].element_size(); return c
def v1(be, c):
    a = (c["q"], c["kc"], c["vc"], c["kv"], 0.088, c["bt"], c["sl"], c["bs"], c["L"], None, "auto", 1.0, 1.0)
    return lambda: be.paged_attention_v1(c["out"], *a)
def bench(fn):
    fn(); torch.cuda.synchronize(); return do_bench(fn, rep=30, warmup=5) * 1e3
pct = lambda c, us: 100 * c["bytes"] / (us * 1e-6) / 1e9 / COPY
orig_choose, orig_pps, orig_min = configs.choose_config, configs.PROGRAMS_PER_SM, configs.MIN_TOKENS_PER_SPLIT
def backend(cfg, pps=4, mins=512):
    configs.choose_config = lambda *a, **k: cfg
    configs.PROGRAMS_PER_SM = pps; configs.MIN_TOKENS_PER_SPLIT = mins
    return get_backend("triton", limits=lim)
def cands(G):
    g = max(1, triton.next_power_of_2(G))
    out = []
    for bn, w, s, pf in ((16, 2, 1, True), (16, 4, 1, True), (32, 4, 1, True), (64, 4, 1, True), (16, 4, 3, False),
                         (32, 4, 3, False), (64, 4, 3, False), (64, 8, 3, False)):
        out.append(KC(bn, max(16, g), w, s, True, pf))
    for hb in sorted({g, 1}):
        for bn, w, s, pf in ((16, 2, 1, True), (16, 4, 1, True), (32, 4, 1, True), (16, 4, 3, False), (32, 4, 3, False),
                             (64, 4, 3, False), (64, 8, 3, False)):
            if hb * bn * 128 // (w * 32) > 256: continue       # register tile too big
            out.append(KC(bn, hb, w, s, False, pf))
    return out
rows = [(torch.float16, 32, 8, 64, 8192), (torch.float16, 32, 8, 1, 32768), (torch.float16, 32, 32, 32, 8192),
        (torch.bfloat16, 64, 8, 64, 8192), (torch.float16, 32, 8, 256, 2048), (torch.float16, 32, 8, 8, 2048)]
t0 = time.time()
for dtype, h, kv, ns, L in rows:
    c = make(dtype, h, kv, ns, L); res = []
    for cfg in cands(h // kv):
        try:
            us = bench(v1(backend(cfg), c))
        except Exception as e:
            print("ERR", cfg, str(e)[:200], flush=True); continue
        res.append((us, cfg)); R["sweep"].append(dict(dtype=str(dtype), heads=(h, kv), ns=ns, L=L, cfg=cfg.__dict__, pps=4, us=us, pct=pct(c, us)))
        print(f"[{time.time()-t0:.0f}s] {str(dtype)[6:]} ({h},{kv}) {ns}x{L} {cfg.block_n}/{cfg.heads_block}/w{cfg.num_warps}/s{cfg.num_stages}/dot{int(cfg.use_dot)}/pf{int(cfg.prefetch)}: {us:.1f}us {pct(c, us):.1f}%", flush=True)
    res.sort(key=lambda r: r[0])
    for us0, cfg in res[:3]:
        for pps, mins in ((2, 512), (8, 256), (16, 256), (32, 128)):
            us = bench(v1(backend(cfg, pps, mins), c))
            R["sweep"].append(dict(dtype=str(dtype), heads=(h, kv), ns=ns, L=L, cfg=cfg.__dict__, pps=pps, mins=mins, us=us, pct=pct(c, us)))
            print(f"   pps{pps} min{mins} {cfg.block_n}/{cfg.heads_block}/w{cfg.num_warps}/s{cfg.num_stages}/dot{int(cfg.use_dot)}/pf{int(cfg.prefetch)}: {us:.1f}us {pct(c, us):.1f}%", flush=True)
    save(); del c; torch.cuda.empty_cache()
print("done", time.time() - t0, flush=True)
