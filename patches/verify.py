"""``biv100-patch verify``: the installed vLLM's own decode path, through the patch, on this device.

Runs ``vllm.attention.ops.paged_attn.PagedAttention.forward_decode`` on two paged cases chosen so
that vLLM's own rule (``use_v1 = max_seq_len <= 8192 and (partitions == 1 or num_seqs * num_heads
> 512)``) picks ``paged_attention_v1`` for one and ``paged_attention_v2`` for the other, and
compares each output with a float64 reference computed on the CPU (fp64 is unreliable on some
devices, BI-V100 among them). Prints the max error and pass/fail per case.
"""

import inspect
import math

PARTITION_SIZE = 512
TOLERANCES = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}
# (label, seq_lens): one partition -> v1; several partitions and few seqs x heads -> v2.
CASES = (("v1", [1, 17, 300, 511]), ("v2", [700, 2100]))
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 128, 16


def expected_op(num_seqs, num_heads, max_seq_len):
    partitions = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    use_v1 = max_seq_len <= 8192 and (partitions == 1 or num_seqs * num_heads > 512)
    return "paged_attention_v1" if use_v1 else "paged_attention_v2"


def make_case(torch, seq_lens, dtype, seed):
    """Uniform(-1, 1) inputs on the CPU with each sequence's blocks scattered through the cache."""
    generator = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(per_seq) + 4
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for s, count in enumerate(per_seq):
        tables[s, :count] = order[start:start + count]
        start += count

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator, dtype=torch.float32) * 2 - 1).to(dtype)

    return {"query": uniform(len(seq_lens), NUM_HEADS, HEAD_SIZE),
            "key_cache": uniform(num_blocks, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x),
            "value_cache": uniform(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE),
            "block_tables": tables, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "max_seq_len": max(seq_lens)}


def reference(torch, case):
    """Exact attention in float64 on the CPU: [num_seqs, num_heads, head_size]."""
    query = case["query"].double()
    keys, values = case["key_cache"].double(), case["value_cache"].double()
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.zeros_like(query)
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        blocks = case["block_tables"][s, :math.ceil(seq_len / BLOCK_SIZE)].long()
        k = keys[blocks].permute(1, 0, 3, 2, 4).reshape(NUM_KV_HEADS, -1, HEAD_SIZE)[:, :seq_len]
        v = values[blocks].permute(1, 0, 3, 2).reshape(NUM_KV_HEADS, -1, HEAD_SIZE)[:, :seq_len]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        weights = torch.softmax(torch.einsum("hd,htd->ht", query[s], k) * HEAD_SIZE ** -0.5, dim=1)
        out[s] = torch.einsum("ht,htd->hd", weights, v)
    return out


def verify(backend="auto", device=None, dtype=None, echo=print):
    """Run both cases; returns a report dict with ``ok`` (False also when nothing could run)."""
    import torch

    from biv100_patch import patches
    try:
        from vllm.attention.ops.paged_attn import PagedAttention
    except Exception as error:
        echo(f"FAIL: vLLM's PagedAttention cannot be imported ({type(error).__name__}: {error})")
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    patches.apply(backend)
    state = patches.state()
    if state.get("status") != "patched":
        echo(f"FAIL: the patch is not applied ({state.get('status')}): {state.get('reason')}")
        return {"ok": False, "state": state}
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, dtype) if dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    dtype_name = str(dtype).replace("torch.", "")
    tolerance = TOLERANCES[dtype_name]
    echo(f"vLLM {state['vllm_version']} ({state['family']} family), {state['backend']} backend, {device}, "
         f"{dtype_name}")

    from .apply import _patch as applied  # the ops object, to see which op vLLM called
    calls = []
    counted = {}
    for name in ("paged_attention_v1", "paged_attention_v2"):
        method = getattr(applied.ops, name)

        def count(*args, _method=method, _name=name, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)
        counted[name] = count
    scale_one = (torch.tensor(1.0, dtype=torch.float32, device=device) if state["family"] == "0.7.0-0.24.x"
                 else 1.0)
    parameters = inspect.signature(PagedAttention.forward_decode).parameters
    results = []
    try:
        for name, function in counted.items():
            setattr(applied.ops, name, function)
        for seed, (label, seq_lens) in enumerate(CASES):
            case = make_case(torch, seq_lens, dtype, seed)
            arguments = {key: value.to(device) for key, value in case.items() if key != "max_seq_len"}
            arguments.update(max_seq_len=case["max_seq_len"], kv_cache_dtype="auto", num_kv_heads=NUM_KV_HEADS,
                             scale=HEAD_SIZE ** -0.5, alibi_slopes=None, k_scale=scale_one, v_scale=scale_one,
                             kv_scale=1.0, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                             blocksparse_block_size=64, blocksparse_head_sliding_step=0)
            del calls[:]
            output = PagedAttention.forward_decode(**{k: arguments[k] for k in parameters if k in arguments})
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            error = (output.detach().cpu().double() - reference(torch, case)).abs().max().item()
            wanted = expected_op(len(seq_lens), NUM_HEADS, case["max_seq_len"])
            ok = math.isfinite(error) and error <= tolerance and calls == [wanted]
            results.append({"case": label, "seq_lens": seq_lens, "op": calls[0] if calls else None,
                            "expected_op": wanted, "max_error": error, "tolerance": tolerance, "ok": ok})
            echo(f"{'PASS' if ok else 'FAIL'} {label}: vLLM called {', '.join(calls) or 'none of our ops'} "
                 f"(expected {wanted}); max error {error:.3e} (tolerance {tolerance:.0e})")
    finally:
        for name in counted:
            vars(applied.ops).pop(name, None)
    routed = patches.state().get("routed_to_torch") or []
    if routed:
        echo(f"note: the {state['backend']} backend failed on {len(routed)} shape(s); the torch backend answered")
    ok = all(result["ok"] for result in results)
    echo("verify: " + ("PASS" if ok else "FAIL"))
    return {"ok": ok, "cases": results, "state": patches.state()}
