"""The PyTorch backend: vLLM's paged-attention decode (v1 and v2) with tensor ops only.

The fallback where Triton is not viable, and the CPU path. ``forward(call)`` takes a validated
``contract.DecodeCall`` and writes ``out`` (v1) or ``out``, ``max_logits``, ``exp_sums`` and
``tmp_out`` (v2) in place.

How it works. Work is split into tiles of (a chunk of sequences) x (a run of 512-token
partitions); within a tile everything is batched over sequences, KV heads, partitions and the
query heads of a group (no Python loop per token or partition). Per tile::

    K, V    one index_select each through the block table, straight into the layout bmm wants:
            [kv_heads, seqs, partitions, 512, head_size]; fp8 decoded by one 256-entry table lookup
    logits  bmm(q group [G, D], K^T) -> float32 q.k; * scale (+ ALiBi, block-sparse -FLT_MAX)
    softmax per partition: max, sum of exp, p = exp / (sum + 1e-6) rounded to the query dtype
            (vLLM's rounding), then bmm(p, V) accumulated in float32: the normalised partition output

Then, per chunk of sequences, the partitions are reduced into ``out`` with vLLM's rescaling
(``w_p = exp_sum_p * exp(max_p - max)``, ``out = sum_p tmp_out_p * w_p / (sum_p w_p + 1e-6)``, a
single partition copied). v2 writes its three per-partition outputs only for partitions
``p < ceil(seq_len / 512)`` and reduces from the ``tmp_out`` values it wrote (query dtype, like
vLLM's reduce kernel); v1 reduces from the float32 partition outputs. seq_len 0 gives zeros.

Masking. Slots past a sequence's end and blocks it does not use may hold anything, NaN included.
Only a sequence's last partition mixes used and unused slots: there the logits of unused slots
become -inf and their V is zeroed (0 * NaN would be NaN). Partitions wholly past the end are
computed on whatever block 0 holds and then discarded (``torch.where``, never a multiply).
Masking therefore touches one partition per sequence, not the whole gathered cache.

Memory traffic (what the speed rests on). Each K and V byte is read by the gather, written once
in the matmul layout and read once by the matmul; the float32 logits take a handful of passes
(bmm, max, add-and-exp with the scale folded in, sum, the rounded probabilities), about
``4 * G / head_size`` of the K+V bytes each.

Matmul precision. Where ``torch.bmm`` takes ``out_dtype`` for the device (CUDA on recent torch)
the gathered cache stays in its dtype and the products accumulate and come out in float32;
elsewhere (CPU, older torch such as the BI-V100's 2.1) K, V and the probabilities are upcast to
float32 first. Both give float32 logits and float32 accumulation of exactly the rounded p.

Peak extra memory. A tile's working set (gathered K and V, their float32 copies where needed,
fp8 lookup indices, float32 logits and weights, rounded probabilities) is estimated per token
(``_bytes_per_token``) and kept under ``MAX_TILE_BYTES`` (256 MiB); a tile never shrinks below one
partition of one sequence, so the bound is ``max(MAX_TILE_BYTES, 512 * bytes_per_token)``, plus
float32 partition results ``[chunk_seqs, num_heads, max_num_partitions, head_size + 2]`` per chunk
(about ``4 * G / (512 * element_size)`` of that chunk's gathered V bytes).

Bad tables (documented decision). A sequence whose used block-table entries leave
``[0, num_blocks)``, whose seq_len needs more columns than ``block_tables`` has, or whose seq_len is
negative or > max_seq_len is never read or written out of bounds (indices are clamped): its
``out`` and its written partition entries become NaN. ``validate_tables=True`` (the backend's
option, ``BIV100_PATCH_VALIDATE=1``) raises ``ValueError`` for these before anything is written.

No host synchronisation: sizes come from ``max_seq_len`` and the tensors' shapes, ``k_scale`` /
``v_scale`` tensors stay on the device.
"""

import math

import torch

from . import fp8
from .contract import PARTITION_SIZE

MAX_TILE_BYTES = 256 * 1024 * 1024
FLT_MAX = 3.4028234663852886e38  # vLLM's logit for tokens a block-sparse head skips
_MIXED_BMM = {}


def _bmm_float32_out(device, dtype):
    """Whether ``torch.bmm(a, b, out_dtype=torch.float32)`` works for ``dtype`` inputs on ``device``."""
    if dtype == torch.float32:
        return True
    key = (device.type, dtype)
    if key not in _MIXED_BMM:
        probe = torch.zeros(1, 1, 1, dtype=dtype, device=device)
        try:
            _MIXED_BMM[key] = torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MIXED_BMM[key] = False
    return _MIXED_BMM[key]


def _bmm32(a, b, mixed):
    """float32 ``a @ b`` (batched) accumulated in float32."""
    if a.dtype == b.dtype == torch.float32:
        return torch.bmm(a, b)
    if mixed:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _bytes_per_token(call, mixed):
    """Upper bound of a tile's working set per cached token of one sequence (all heads)."""
    elem = call.query.element_size()
    if mixed:  # K and V gathered in the query dtype; fp8: V's bits and int32 lookup indices meanwhile
        per_dim = 2 * elem + (5 if call.kv_cache_dtype != "auto" else 0)
    else:      # K and V in float32, plus the picked blocks (fp8: also their permuted bits and indices)
        per_dim = 2 * 4 + (6 if call.kv_cache_dtype != "auto" else elem)
    per_head = 4 + 4 + elem + (0 if mixed else 4)            # q.k, exp, rounded p (and its float32 copy)
    if call.alibi_slopes is not None or call.blocksparse is not None or call.scale <= 0:
        per_head += 8 + 1                                    # scaled logits, ALiBi term, block-sparse mask
    return call.num_kv_heads * call.head_size * per_dim + call.num_heads * per_head + 16


def _partition_overhead(call):
    """Per-partition bytes of a tile besides its tokens: the query copy and float32 partition outputs."""
    return call.num_heads * call.head_size * (call.query.element_size() + 4 + 4) + 64


def _plan(call, mixed):
    """(columns per partition, chunk of sequences, partitions per tile, bytes one tile may use)."""
    partitions = call.max_num_partitions
    block_size = call.block_size
    if partitions > 1:
        columns = PARTITION_SIZE // block_size
    else:  # a single partition only needs max_seq_len tokens
        columns = (call.max_seq_len + block_size - 1) // block_size
    per_partition = columns * block_size * _bytes_per_token(call, mixed) + _partition_overhead(call)
    per_sequence = per_partition * partitions
    if per_sequence <= MAX_TILE_BYTES:
        chunk = min(max(call.num_seqs, 1), MAX_TILE_BYTES // per_sequence)
        return columns, chunk, partitions, chunk * per_sequence
    tile_parts = max(1, MAX_TILE_BYTES // per_partition)
    return columns, 1, tile_parts, tile_parts * per_partition


def peak_extra_bytes(call):
    """Upper bound of the memory ``forward(call)`` allocates besides its arguments (a tile, a chunk's
    partition results, per-call index tensors)."""
    mixed = _bmm_float32_out(call.query.device, call.query.dtype)
    _, chunk, _, tile_bytes = _plan(call, mixed)
    heads, partitions, head_size = call.num_heads, max(call.max_num_partitions, 1), call.head_size
    chunk_bytes = chunk * heads * (partitions * (head_size * (4 + call.query.element_size()) + 16) + head_size * 8)
    call_bytes = call.num_seqs * (call.block_tables.shape[1] * 20 + 64) + 4096
    return tile_bytes + chunk_bytes + call_bytes


def _bad_sequences(call, lens):
    """bool [num_seqs]: sequences whose table or length would read out of bounds (see module docstring)."""
    used_blocks = (lens.clamp(min=0) + call.block_size - 1) // call.block_size
    columns = call.block_tables.shape[1]
    bad = (lens < 0) | (lens > call.max_seq_len) | (used_blocks > columns)
    if columns:
        tables = call.block_tables.long()
        used = torch.arange(columns, device=lens.device)[None, :] < used_blocks[:, None]
        bad |= (used & ((tables < 0) | (tables >= call.num_blocks))).any(dim=1)
    return bad


def _caches(call):
    """The caches as stored; fp8 ones as their uint8 bit patterns (also when they come as torch float8)."""
    if call.kv_cache_dtype == "auto":
        return call.key_cache, call.value_cache
    return call.key_cache.view(torch.uint8), call.value_cache.view(torch.uint8)


# Cache block [kv_heads, D/x, block, x] / [kv_heads, D, block] -> [kv_heads, block, D/x, x] / [kv_heads, block, D].
_KEY_ORDER, _VALUE_ORDER = (1, 0, 3, 2, 4), (1, 0, 3, 2)


def _gather(cache, order, blocks, mixed, dtype):
    """``cache[blocks]`` in the matmul layout ``[kv_heads, len(blocks), block_size, ...]``, contiguous.

    With ``mixed`` (CUDA) one index_select reads the permuted cache directly. Elsewhere the blocks
    are picked as stored and permuted by the copy that also converts them to ``dtype`` (CPU
    index_select would first copy a permuted cache whole).
    """
    if mixed:
        return torch.index_select(cache.permute(order), 1, blocks).to(dtype)
    picked = torch.index_select(cache, 0, blocks).permute(order)
    return torch.empty(picked.shape, dtype=dtype, device=picked.device).copy_(picked)


def _head_offsets(call, device):
    """Block-sparse head offset of each query head, shaped [kv_heads, 1, 1, group, 1]."""
    sparse = call.blocksparse
    heads = torch.arange(call.num_heads, device=device)
    if sparse.head_sliding_step >= 0:
        offsets = (sparse.tp_rank * call.num_heads + heads) * sparse.head_sliding_step + 1
    else:
        kv_heads = heads // call.queries_per_kv
        offsets = (sparse.tp_rank * call.num_kv_heads + kv_heads) * (-sparse.head_sliding_step) + 1
    return offsets.view(call.num_kv_heads, 1, 1, call.queries_per_kv, 1)


def _tile(call, caches, tables, lens, seqs, parts, columns, mixed, scaled_tables):
    """Per-partition (max, exp_sum, normalised float32 output) of ``seqs`` x ``parts``.

    Returns tensors shaped [chunk, num_heads, tile_partitions] (x head_size for the output).
    """
    device = call.query.device
    kv_heads, group, head_size = call.num_kv_heads, call.queries_per_kv, call.head_size
    block_size, num_blocks = call.block_size, call.num_blocks
    num_seqs, num_parts = seqs.stop - seqs.start, parts.stop - parts.start
    width = columns * block_size  # tokens per partition in this call
    key_cache, value_cache = caches

    # Block ids of the tile; unused and out-of-range entries read block 0 (masked or discarded later).
    cols = torch.arange(parts.start * columns, parts.stop * columns, device=device)
    seq_lens = lens[seqs]
    used = cols[None, :] < ((seq_lens.clamp(min=0) + block_size - 1) // block_size)[:, None]
    if tables.shape[1]:
        entries = tables[seqs][:, cols.clamp(max=tables.shape[1] - 1)]
        used &= (cols < tables.shape[1])[None, :] & (entries >= 0) & (entries < num_blocks)
        blocks = torch.where(used, entries, 0).reshape(-1)
    else:
        blocks = torch.zeros(num_seqs * cols.numel(), dtype=torch.long, device=device)

    shape = (kv_heads, num_seqs, num_parts, width, head_size)
    if scaled_tables is None:  # float32 where the matmuls cannot take half inputs with float32 output
        dtype = call.query.dtype if mixed else torch.float32
        keys = _gather(key_cache, _KEY_ORDER, blocks, mixed, dtype).view(shape)
        values = _gather(value_cache, _VALUE_ORDER, blocks, mixed, dtype).view(shape)
    else:  # fp8: one lookup decodes and applies vLLM's scale and rounding
        keys = fp8.lookup(scaled_tables[0], _gather(key_cache, _KEY_ORDER, blocks, mixed, torch.uint8)).view(shape)
        values = fp8.lookup(scaled_tables[1], _gather(value_cache, _VALUE_ORDER, blocks, mixed, torch.uint8))
        values = values.view(shape)

    # Only each sequence's last partition mixes used and unused slots (partitions wholly past the end
    # are discarded by the caller), so masking that one partition per sequence is enough.
    last = ((seq_lens.clamp(min=1) + PARTITION_SIZE - 1) // PARTITION_SIZE - 1 - parts.start).clamp(0, num_parts - 1)
    rows = torch.arange(num_seqs, device=device)
    last_valid = ((parts.start + last)[:, None] * width + torch.arange(width, device=device)) < seq_lens[:, None]
    values[:, rows, last] = torch.where(last_valid[None, :, :, None], values[:, rows, last], 0)  # 0 * NaN is NaN

    query = call.query[seqs].unflatten(1, (kv_heads, group)).permute(1, 0, 2, 3)   # [kv, seqs, G, D]
    query = query[:, :, None].expand(kv_heads, num_seqs, num_parts, group, head_size)
    batch = kv_heads * num_seqs * num_parts
    logits = _bmm32(query.reshape(batch, group, head_size),
                    keys.reshape(batch, width, head_size).transpose(1, 2), mixed)
    logits = logits.view(kv_heads, num_seqs, num_parts, group, width)              # q.k, float32
    scale, keep = call.scale, None
    if call.alibi_slopes is not None or call.blocksparse is not None or scale <= 0:
        logits, scale = logits * scale, 1.0                                        # explicit logits
        tokens = (torch.arange(parts.start, parts.stop, device=device)[:, None] * width
                  + torch.arange(width, device=device)[None, :])                   # [parts, width]
        if call.alibi_slopes is not None:
            position = (tokens[None] - seq_lens[:, None, None] + 1).float()[None, :, :, None, :]
            logits += call.alibi_slopes.view(kv_heads, 1, 1, group, 1) * position
        if call.blocksparse is not None:
            sparse = call.blocksparse
            key_blocks = ((tokens // block_size) * block_size // sparse.block_size)[None, None, :, None, :]
            query_blocks = ((seq_lens - 1) // sparse.block_size)[None, :, None, None, None]
            keep = ((key_blocks + _head_offsets(call, device)) % sparse.vert_stride == 0) \
                | (key_blocks > query_blocks - sparse.local_blocks)
            logits = torch.where(keep, logits, -FLT_MAX)
    logits[:, rows, last] = torch.where(last_valid[None, :, None, :], logits[:, rows, last], -math.inf)

    # Otherwise the scale is folded in: max(scale * qk) = scale * max(qk) for scale > 0, and
    # exp(scale * qk - max) is one add and one exp over the tile.
    top = logits.amax(dim=-1) * scale
    weights = torch.add(-top[..., None], logits, alpha=scale).exp_()
    total = weights.sum(dim=-1)
    probs = torch.empty(weights.shape, dtype=call.query.dtype, device=device)
    torch.mul(weights, (1.0 / (total + 1e-6))[..., None], out=probs)               # vLLM rounds p to the query dtype
    if keep is not None:  # skipped tokens count in the sum but their V is never read
        probs.masked_fill_(~keep, 0)
    outputs = _bmm32(probs.view(batch, group, width), values.reshape(batch, width, head_size), mixed)

    def by_head(tensor):  # [kv, seqs, parts, G, ...] -> [seqs, heads, parts, ...]
        tensor = tensor.permute(1, 0, 3, 2, *range(4, tensor.dim()))
        return tensor.reshape(num_seqs, kv_heads * group, num_parts, *tensor.shape[4:])

    return by_head(top), by_head(total), by_head(outputs.view(kv_heads, num_seqs, num_parts, group, head_size))


def forward(call):
    """Run one validated decode call (``contract.DecodeCall``), writing its outputs in place."""
    device = call.query.device
    num_seqs, num_heads, head_size = call.num_seqs, call.num_heads, call.head_size
    partitions = call.max_num_partitions
    if num_seqs == 0:
        return
    lens = call.seq_lens.long()
    bad = _bad_sequences(call, lens)
    parts_used = ((lens.clamp(min=0) + PARTITION_SIZE - 1) // PARTITION_SIZE).clamp(max=partitions)

    if partitions == 0 or call.num_blocks == 0:  # nothing can be read: zeros, NaN for bad sequences
        call.out.copy_(torch.where(bad[:, None, None], math.nan, 0.0).expand(call.out.shape))
        if call.is_v2:
            for buffer in (call.max_logits, call.exp_sums, call.tmp_out):
                written = (torch.arange(partitions, device=device)[None, :] < parts_used[:, None])
                mask = (written & bad[:, None]).view(num_seqs, 1, partitions, *([1] * (buffer.dim() - 3)))
                region = buffer[:, :, :partitions]
                region.copy_(torch.where(mask, math.nan, region))
        return

    compute_dtype = call.query.dtype
    mixed = _bmm_float32_out(device, compute_dtype)
    scaled_tables = None
    if call.kv_cache_dtype != "auto":
        # Where the matmuls upcast anyway, decode straight to float32 (rounded to the query dtype first).
        table_dtype = compute_dtype if mixed else torch.float32
        scaled_tables = tuple(fp8.scaled_table(call.kv_cache_dtype, scale, compute_dtype, device).to(table_dtype)
                              for scale in (call.k_scale, call.v_scale))
    columns, chunk, tile_parts, _ = _plan(call, mixed)
    caches = _caches(call)
    tables = call.block_tables.long()
    part_ids = torch.arange(partitions, device=device)

    for start in range(0, num_seqs, chunk):
        seqs = slice(start, min(start + chunk, num_seqs))
        count = seqs.stop - seqs.start
        tops = torch.empty(count, num_heads, partitions, device=device)
        totals = torch.empty_like(tops)
        outs = torch.empty(count, num_heads, partitions, head_size, device=device)
        for first in range(0, partitions, tile_parts):
            parts = slice(first, min(first + tile_parts, partitions))
            tops[:, :, parts], totals[:, :, parts], outs[:, :, parts] = _tile(
                call, caches, tables, lens, seqs, parts, columns, mixed, scaled_tables)

        written = (part_ids[None, :] < parts_used[seqs, None])[:, None, :]         # [seqs, 1, parts]
        seq_bad = bad[seqs].view(count, 1, 1)
        tops.masked_fill_(seq_bad, math.nan)
        totals.masked_fill_(seq_bad, math.nan)
        outs.masked_fill_(seq_bad[..., None], math.nan)
        if call.is_v2:
            for buffer, values in ((call.max_logits, tops), (call.exp_sums, totals)):
                region = buffer[seqs, :, :partitions]
                region.copy_(torch.where(written, values, region))
            region = call.tmp_out[seqs, :, :partitions]
            rounded = outs.to(call.tmp_out.dtype)
            region.copy_(torch.where(written[..., None], rounded, region, out=rounded))
            outs.copy_(rounded)  # vLLM's reduce reads tmp_out in the query dtype
            del rounded

        # vLLM's reduce: w_p = exp_sum_p * exp(max_p - max), out = sum_p out_p * w_p / (sum_p w_p + 1e-6).
        best = torch.where(written, tops, -math.inf).amax(dim=-1, keepdim=True)
        rescaled = torch.where(written, totals * torch.exp(tops - best), 0.0)
        inverse = 1.0 / (rescaled.sum(dim=-1, keepdim=True) + 1e-6)
        first_partition = outs[:, :, 0].clone()
        outs.masked_fill_(~written[..., None], 0.0)  # unwritten partitions may hold NaN
        reduced = outs.mul_((rescaled * inverse)[..., None]).sum(dim=2)
        single = (parts_used[seqs] == 1).view(count, 1, 1)
        reduced = torch.where(single, first_partition, reduced)
        reduced = torch.where(seq_bad, math.nan, reduced)
        call.out[seqs].copy_(reduced)
