"""An independent float64 reference of vLLM's paged-attention decode op (v1 and v2).

Deliberately simple: a loop over sequences, exact float64 arithmetic on the CPU, an exact
softmax without vLLM's 1e-6. fp8 caches are decoded from their bit patterns here (not through
``kernels.fp8``) and multiplied by k_scale / v_scale in float64, like the golden files' reference.

    ref = reference_attention(**inputs)          # inputs: the op's arguments by name
    ref["out"]         [num_seqs, num_heads, head_size]                      float64
    ref["max_logits"]  [num_seqs, num_heads, max_num_partitions]             float64, NaN where unwritten
    ref["exp_sums"]    [num_seqs, num_heads, max_num_partitions]             float64, NaN where unwritten
    ref["tmp_out"]     [num_seqs, num_heads, max_num_partitions, head_size]  float64, NaN where unwritten
    ref["written"]     [num_seqs, num_heads, max_num_partitions]             bool, p < ceil(seq_len / 512)
"""

import math

import torch

PARTITION_SIZE = 512
FLT_MAX = 3.4028234663852886e38  # vLLM gives block-sparse skipped tokens the logit -FLT_MAX


def fp8_bits_to_float64(bits, fmt):
    """Decode uint8 fp8 bit patterns (``fmt`` "fp8_e4m3" = e4m3fn, or "fp8_e5m2") exactly to float64."""
    b = bits.to(torch.int64)
    sign = torch.where(b >= 128, -1.0, 1.0).to(torch.float64)
    if fmt == "fp8_e4m3":
        exponent, mantissa, mantissa_bits, bias = (b >> 3) & 0xF, b & 0x7, 3, 7
        special = (exponent == 15) & (mantissa == 7)
        special_value = torch.full_like(sign, math.nan)
    elif fmt == "fp8_e5m2":
        exponent, mantissa, mantissa_bits, bias = (b >> 2) & 0x1F, b & 0x3, 2, 15
        special = exponent == 31
        special_value = torch.where(mantissa == 0, math.inf, math.nan).to(torch.float64)
    else:
        raise ValueError(f"fmt: must be fp8_e4m3 or fp8_e5m2; got {fmt!r}")
    fraction = mantissa.to(torch.float64) / (1 << mantissa_bits)
    normal = (1.0 + fraction) * torch.pow(2.0, (exponent - bias).to(torch.float64))
    subnormal = fraction * 2.0 ** (1 - bias)
    magnitude = torch.where(exponent == 0, subnormal, normal)
    return torch.where(special, special_value, magnitude) * sign


def float_to_fp8_bits(values, fmt):
    """Round float values to the nearest finite fp8 value of ``fmt``; returns uint8 bit patterns."""
    codes = torch.arange(256, dtype=torch.int64)
    table = fp8_bits_to_float64(codes, fmt)
    finite = torch.isfinite(table)
    table, order = torch.sort(table[finite])
    codes = codes[finite][order]
    flat = values.detach().to("cpu", torch.float64).reshape(-1)
    upper = torch.searchsorted(table, flat).clamp(1, table.numel() - 1)
    lower = upper - 1
    nearest = torch.where((flat - table[lower]).abs() <= (table[upper] - flat).abs(), lower, upper)
    return codes[nearest].to(torch.uint8).reshape(values.shape)


def _decode(cache, kv_cache_dtype, scale):
    cache = cache.detach().cpu()
    if kv_cache_dtype == "auto":
        return cache.to(torch.float64)
    fmt = "fp8_e4m3" if kv_cache_dtype in ("fp8", "fp8_e4m3") else kv_cache_dtype
    table = fp8_bits_to_float64(torch.arange(256), fmt)
    return table[cache.view(torch.uint8).long()] * float(scale)


def _blocksparse_keep(blocksparse, seq_len, block_size, num_heads, num_kv_heads):
    """[num_heads, seq_len] bool: vLLM's rule for which tokens a block-sparse head attends to."""
    tp_rank = blocksparse.get("tp_rank", 0)
    local_blocks = blocksparse["local_blocks"]
    vert_stride = blocksparse["vert_stride"]
    bs_block_size = blocksparse["block_size"]
    sliding_step = blocksparse["head_sliding_step"]
    q_blk = (seq_len - 1) // bs_block_size
    token = torch.arange(seq_len)
    k_blk = (token // block_size) * block_size // bs_block_size
    keep = torch.empty(num_heads, seq_len, dtype=torch.bool)
    for head in range(num_heads):
        if sliding_step >= 0:
            offset = (tp_rank * num_heads + head) * sliding_step + 1
        else:
            kv_head = head // (num_heads // num_kv_heads)
            offset = (tp_rank * num_kv_heads + kv_head) * (-sliding_step) + 1
        keep[head] = ((k_blk + offset) % vert_stride == 0) | (k_blk > q_blk - local_blocks)
    return keep


def reference_attention(query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                        max_seq_len=None, alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                        blocksparse=None, **_ignored):
    """Float64 outputs of the op (see the module docstring).

    ``blocksparse``: None, or a dict with local_blocks, vert_stride, block_size, head_sliding_step
    (and optionally tp_rank); it applies when vert_stride > 1. k_scale/v_scale: float or tensor.
    """
    q_all = query.detach().cpu().to(torch.float64)
    num_seqs, num_heads, head_size = q_all.shape
    group = num_heads // num_kv_heads
    keys = _decode(key_cache, kv_cache_dtype, k_scale)
    values = _decode(value_cache, kv_cache_dtype, v_scale)
    tables = block_tables.detach().cpu().to(torch.int64)
    lens = [int(n) for n in seq_lens.detach().cpu()]
    if max_seq_len is None:
        max_seq_len = max(lens, default=0)
    num_partitions = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    slopes = None if alibi_slopes is None else alibi_slopes.detach().cpu().to(torch.float64)
    sparse = blocksparse if blocksparse is not None and blocksparse["vert_stride"] > 1 else None

    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    max_logits = torch.full((num_seqs, num_heads, num_partitions), math.nan, dtype=torch.float64)
    exp_sums = torch.full_like(max_logits, math.nan)
    tmp_out = torch.full((num_seqs, num_heads, num_partitions, head_size), math.nan, dtype=torch.float64)
    written = torch.zeros(num_seqs, num_heads, num_partitions, dtype=torch.bool)

    for s, seq_len in enumerate(lens):
        if seq_len == 0:
            continue
        blocks = tables[s, : (seq_len + block_size - 1) // block_size]
        # [blocks, kv_heads, D/x, block, x] -> [kv_heads, tokens, D]
        k = keys[blocks].permute(1, 0, 3, 2, 4).reshape(num_kv_heads, -1, head_size)[:, :seq_len]
        # [blocks, kv_heads, D, block] -> [kv_heads, tokens, D]
        v = values[blocks].permute(1, 0, 3, 2).reshape(num_kv_heads, -1, head_size)[:, :seq_len]
        k = k.repeat_interleave(group, dim=0)  # [heads, tokens, D]
        v = v.repeat_interleave(group, dim=0)
        logits = scale * torch.einsum("hd,htd->ht", q_all[s], k)
        if slopes is not None:
            logits = logits + slopes[:, None] * (torch.arange(seq_len, dtype=torch.float64) - seq_len + 1)
        keep = torch.ones(num_heads, seq_len, dtype=torch.bool)
        if sparse is not None:
            keep = _blocksparse_keep(sparse, seq_len, block_size, num_heads, num_kv_heads)
            logits = torch.where(keep, logits, -FLT_MAX)
        # Skipped tokens still count in the sum (exp(-FLT_MAX - max), vLLM's rule) but their V is never read.
        v = torch.where(keep[..., None], v, 0.0)

        def attend(lo, hi):
            part = logits[:, lo:hi]
            top = part.max(dim=1).values
            weights = torch.exp(part - top[:, None])
            total = weights.sum(dim=1)
            return top, total, torch.einsum("ht,htd->hd", weights, v[:, lo:hi]) / total[:, None]

        out[s] = attend(0, seq_len)[2]
        for p in range((seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE):
            top, total, part_out = attend(p * PARTITION_SIZE, min((p + 1) * PARTITION_SIZE, seq_len))
            if p < num_partitions:
                max_logits[s, :, p], exp_sums[s, :, p], tmp_out[s, :, p] = top, total, part_out
                written[s, :, p] = True
    return {"out": out, "max_logits": max_logits, "exp_sums": exp_sums, "tmp_out": tmp_out, "written": written}
