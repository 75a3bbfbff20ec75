"""The PyTorch backend: vLLM's paged-attention decode (v1 and v2) with tensor ops only.

The fallback where Triton is not viable, and the CPU path. ``forward(call)`` takes a validated
``contract.DecodeCall`` and writes ``out`` (v1) or ``out``, ``max_logits``, ``exp_sums`` and
``tmp_out`` (v2) in place.

How it works. Work is split into tiles of (a chunk of sequences) x (a run of 512-token
partitions); within a tile everything is batched over KV heads, sequences, partitions and the
query heads of a group (no Python loop per token or partition). Per tile::

    K       one gather through the block table, into the layout the matmul reads without a copy:
            [kv_heads, blocks, block_size, head_size] (a [tokens, head_size] matrix per partition);
            fp8 decoded by one 256-entry table lookup
    logits  bmm(q group [G, D], K^T) -> float32 q.k (* scale, + ALiBi, block-sparse -FLT_MAX);
            the gathered K is freed here
    softmax per partition: max, exp(scale * qk - max) in place, sum, p = exp / (sum + 1e-6)
            rounded to the query dtype (vLLM's rounding); v1, where a tile holds whole sequences:
            one softmax over all of a sequence's partitions, as vLLM's v1 kernel takes
    V       one gather, as [head_size, kv_heads, blocks, block_size] (V^T per partition, tokens
            contiguous as in the cache), then bmm(p, V) accumulated in float32: the normalised
            partition output

Then, per group of chunks (as many as ``MAX_RESULT_BYTES`` of partition results hold; where a
sequence spans several tiles, as many sequences), the partitions are reduced into ``out`` with
vLLM's rescaling (``w_p = exp_sum_p * exp(max_p - max)``,
``out = sum_p tmp_out_p * w_p / (sum_p w_p + 1e-6)``, a single partition copied). v2 writes its
three per-partition outputs only for partitions ``p < ceil(seq_len / 512)`` and reduces from the
``tmp_out`` values it wrote (query dtype, like vLLM's reduce kernel). v1's partitions, sharing one
softmax, are summed (where a sequence spans tiles, v1 reduces their float32 outputs as v2 does).
seq_len 0 gives zeros. Per-call tensors (lengths, clamped block ids, written partitions, bad
sequences, the boundary positions of tiles of whole sequences, the query in the matmul layout) are
built once.
Host cost matters as much as bandwidth here: an eager tensor op costs 7-20 us of host time on the
H200's host, and a 2 GB call takes 2.2-3.0 ms of it against 2.45 ms of GPU time. The plain case
(no ALiBi, no block sparsity, scale > 0, kv_cache_dtype "auto", fp16, float32 matmul path) makes
152 torch calls (views and tensor properties included; 102-103 at the top level of ATen) for a v1
call of 8 sequences of 512 or 2048 tokens in one tile (155 and 170 while v1 reduced its partitions),
199-217 for v2; about 60 more per extra tile of whole sequences and about 100 per tile where a
sequence spans several (its boundary is found per tile).

Masking. Slots past a sequence's end and blocks it does not use may hold anything, NaN included.
Only the partition holding a sequence's last token mixes used and unused slots, so only it is
masked: its logits are set to -inf past the end (in place where a tile has one partition per
sequence, else picked per sequence with ``index_select`` and put back); of V, the block holding the
last token is picked and zeroed past the end, the blocks after it in that partition are zeroed
whole (``index_fill_``, in words) and the picked block is put back (0 * NaN would be NaN).
Partitions wholly past the end are computed on whatever their clamped block ids hold and then
discarded (``torch.where`` / ``masked_fill``, never a multiply). v1's one softmax per sequence
needs their logits too: there every slot past the end is set to -inf, in place, one pass over the
tile's logits.

Memory traffic (what the speed rests on). The gather moves whole stored runs: one ``index_select``
on the cache viewed as words and permuted: K in 16-byte words (its ``x`` runs; complex128 where the
device copies those bit-exactly), V in 8-byte ones (pieces of its block rows), never element by
element (on the CPU the blocks are picked along the cache's first dimension into a permuted view of
the result: its index_select would first copy the whole permuted cache). Each K and V byte is thus
read by the gather, written once in the matmul layout and read once by the matmul (plus a float32
copy where the matmuls cannot take the cache dtype: without ``mixed``, below). Masking touches one
partition of logits (v1's one softmax: all of them, once) and one block of V per sequence (plus the
unused blocks after it). The float32 logits take a few passes (bmm, max, scaled subtract, exp, sum,
the rounded probabilities), each about ``2 * G / (head_size * element_size)`` of the K+V bytes (1/32
for fp16, G = 4, head 128).

Matmul precision. Where ``torch.bmm`` takes ``out_dtype`` for the device (CUDA on recent torch)
the gathered cache stays in its dtype and the products accumulate and come out in float32;
elsewhere (CPU, older torch such as the BI-V100's 2.1) K, V and the probabilities are upcast to
float32 first. Both give float32 logits and float32 accumulation of exactly the rounded p.

Peak extra memory. A tile's working set (gathered K or V, its float32 copy where needed, fp8
lookup indices, float32 logits and the picked boundary partition, rounded probabilities) is
estimated per token (``_bytes_per_token``) and kept under ``MAX_TILE_BYTES`` (512 MiB: a 1 GB
fp16 K+V row with 32 query heads on 8 KV heads runs in 2 tiles); a tile never shrinks below one
partition of one sequence, so the bound is ``max(MAX_TILE_BYTES, 512 * bytes_per_token)``, plus
per reduce group the float32 partition results and the reduce's temporaries (``MAX_RESULT_BYTES``
of results, or one chunk's where that is more, and as much again in temporaries), plus the
per-call index tensors; ``peak_extra_bytes(call)`` adds these up.

Bad tables (documented decision). A sequence whose used block-table entries leave
``[0, num_blocks)``, whose seq_len needs more columns than ``block_tables`` has, or whose seq_len is
negative or > max_seq_len is never read or written out of bounds (block ids are clamped): its
``out`` and its written partition entries become NaN. ``validate_tables=True`` (the backend's
option, ``BIV100_PATCH_VALIDATE=1``) raises ``ValueError`` for these before anything is written.

No host synchronisation: sizes come from ``max_seq_len`` and the tensors' shapes, ``k_scale`` /
``v_scale`` tensors stay on the device.
"""

import functools
import math

import torch
import torch.nn.functional as F

from . import fp8
from .contract import PARTITION_SIZE

MAX_TILE_BYTES = 512 * 1024 * 1024
MAX_RESULT_BYTES = 64 * 1024 * 1024  # partition results of the sequences reduced together
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
    """Upper bound of a tile's working set per cached token of one sequence (all heads). K and V are
    gathered one after the other (K is freed first), so one of them counts."""
    elem = call.query.element_size()
    fp8_cache = call.kv_cache_dtype != "auto"
    if mixed:  # gathered in the query dtype; fp8: its bits and int32 lookup indices meanwhile
        per_dim = elem + (5 if fp8_cache else 0)
    else:      # in float32, plus the picked blocks before their conversion (fp8: bits and lookup indices)
        per_dim = 4 + (5 if fp8_cache else 0 if elem == 4 else elem)
    per_head = 4 + 4 + elem + (0 if mixed else 4)  # q.k (exp in place), boundary partition, p (and float32 p)
    if call.alibi_slopes is not None or call.blocksparse is not None or call.scale <= 0:
        per_head += 8 + 1                           # scaled logits, ALiBi term, block-sparse mask
    return call.num_kv_heads * call.head_size * per_dim + call.num_heads * per_head + 16


def _partition_overhead(call, mixed):
    """Per-partition bytes of a tile besides its tokens: the query copy, float32 partition outputs and
    statistics, and (per sequence, so bounded per partition) V's picked boundary block."""
    query_bytes = call.query.element_size() if mixed else 4
    return (call.num_heads * (call.head_size * (query_bytes + 4) + 8)
            + call.num_kv_heads * call.head_size * call.block_size * 4 + 64)


class _Plan:
    """How ``forward`` cuts a call into tiles.

    partitions   512-token partitions per sequence (one of max_seq_len's blocks where it is shorter)
    columns      block-table columns per partition
    chunk        sequences per tile
    tile_parts   partitions per tile (fewer than ``partitions`` where one sequence is over a tile)
    tile_bytes   bytes one tile may use
    joint        one softmax over all of a sequence's partitions, as vLLM's v1 kernel computes it (v1,
                 where a tile holds whole sequences): the partition outputs are then summed, not reduced
    """

    __slots__ = ("partitions", "columns", "chunk", "tile_parts", "tile_bytes", "joint")


def _columns(call):
    """Block-table columns per partition: 512 tokens' worth, or for a single partition max_seq_len's."""
    if call.max_num_partitions > 1:
        return PARTITION_SIZE // call.block_size
    return (call.max_seq_len + call.block_size - 1) // call.block_size


def _plan(call, mixed):
    """The call's ``_Plan``."""
    plan = _Plan()
    plan.partitions = max(call.max_num_partitions, 1)
    plan.columns = _columns(call)
    per_partition = plan.columns * call.block_size * _bytes_per_token(call, mixed) + _partition_overhead(call, mixed)
    per_sequence = per_partition * plan.partitions
    if per_sequence <= MAX_TILE_BYTES:
        plan.chunk = min(max(call.num_seqs, 1), MAX_TILE_BYTES // per_sequence)
        plan.tile_parts, plan.tile_bytes = plan.partitions, plan.chunk * per_sequence
    else:
        plan.chunk, plan.tile_parts = 1, max(1, MAX_TILE_BYTES // per_partition)
        plan.tile_bytes = plan.tile_parts * per_partition
    plan.joint = not call.is_v2 and plan.tile_parts == plan.partitions
    return plan


def _reduce_group(call, plan):
    """Sequences whose partition results are reduced together: whole chunks (single sequences where a
    sequence spans several tiles), as many as ``MAX_RESULT_BYTES`` of results hold. Fewer reduces: each
    is a dozen small tensor ops, and on a slow host those cost more than the tile's matmuls."""
    chunk = 1 if plan.tile_parts < plan.partitions else plan.chunk
    per_chunk = chunk * call.num_heads * plan.partitions * (call.head_size + 2) * 4
    return min(chunk * max(1, MAX_RESULT_BYTES // per_chunk), call.num_seqs)


def peak_extra_bytes(call):
    """Upper bound of the memory ``forward(call)`` allocates besides its arguments (a tile, a reduce group's
    partition results and reduce temporaries, per-call tensors)."""
    mixed = _bmm_float32_out(call.query.device, call.query.dtype)
    plan = _plan(call, mixed)
    heads, partitions, head_size = call.num_heads, plan.partitions, call.head_size
    columns, chunk = plan.columns, plan.chunk
    # per reduced sequence: results (head_size + 2 floats) and as much again in temporaries per partition,
    # two [head_size] sums; plus one tile's results before they are copied into the group's
    reduced = _reduce_group(call, plan)
    chunk_bytes = (reduced * heads * (partitions * (head_size * 8 + 24) + head_size * 8)
                   + chunk * heads * partitions * (head_size + 2) * 4)
    table_columns = call.block_tables.shape[1]
    # index tensors, the boundary (past_end, slot masks, blocks_from_last) and the query in the matmul dtype
    call_bytes = (call.num_seqs * (table_columns * 20 + partitions * (columns * 4 + 2) + 64
                                   + columns * (call.block_size * (partitions if plan.joint else 1) + 8)
                                   + call.block_size + heads * head_size * 4)
                  + 8 * (table_columns + partitions + partitions * columns * call.block_size) + 4096)
    return plan.tile_bytes + chunk_bytes + call_bytes


def _caches(call):
    """The caches as stored; fp8 ones as their uint8 bit patterns (also when they come as torch float8)."""
    if call.kv_cache_dtype == "auto":
        return call.key_cache, call.value_cache
    return call.key_cache.view(torch.uint8), call.value_cache.view(torch.uint8)


# Cache block [kv_heads, D/x, block, x] -> [kv_heads, block, D/x, x]: K's tokens by head_size.
_KEY_ORDER = (1, 0, 3, 2, 4)
# Cache block [kv_heads, D, block] -> [D, kv_heads, block]: V^T, blocks side by side along the tokens.
_VALUE_ORDER = (2, 1, 0, 3)


_WORD_DTYPES = {}


def _word_dtype(device):
    """The widest dtype whose gathers and fills move bits unchanged on ``device``: complex128 (16 bytes,
    one of K's ``x`` runs), else int64. Checked once per device on random bits with the float64 words a
    copy through float registers could change planted among them: quiet and signalling NaNs with
    payloads, denormals of both signs (flushed to zero where fp64 is unreliable)."""
    found = _WORD_DTYPES.get(device)
    if found is None:
        found = torch.int64
        bits = torch.randint(0, 256, (64, 3, 32), dtype=torch.uint8, device=device)
        for row, word in enumerate((0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001, 0x0000000000000001, 0x800FFFFFFFFFFFFF)):
            planted = torch.tensor(list(word.to_bytes(8, "little")), dtype=torch.uint8, device=device)
            bits[row::4, :, 8 * row:8 * row + 8] = planted
        order = torch.randperm(64, device=device)
        try:
            words = bits.view(torch.complex128).permute(1, 0, 2)
            picked = torch.index_select(words, 1, order).view(torch.uint8)
            filled = picked.clone()
            filled.view(torch.complex128).index_fill_(1, order[:5], 0)
            expected = bits.permute(1, 0, 2)[:, order]
            cleared = expected.clone()
            cleared[:, order[:5]] = 0
            if torch.equal(picked, expected) and torch.equal(filled, cleared):
                found = torch.complex128
        except (RuntimeError, TypeError, NotImplementedError):
            pass
        _WORD_DTYPES[device] = found
    return found


def _as_words(tensor, word_bytes):
    """``tensor`` with its innermost dimension read as ``word_bytes``-byte words (16: where the device copies
    complex128 bit-exactly, else 8) where its strides allow, else as is: a gather (or fill) then moves
    whole runs instead of single elements."""
    for dtype in ((_word_dtype(tensor.device), torch.int64) if word_bytes == 16 else (torch.int64,)):
        try:
            return tensor.view(dtype)
        except RuntimeError:
            pass
    return tensor


# Gather word sizes, measured on the H200 (1 GiB of fp16 K or V, block 16): K's 16-byte x runs gather in
# 588 us as 16-byte words, 847 us as 8-byte ones; V's 32-byte block rows in 823 us as 8-byte words, 880 us
# as 16-byte ones (a 1 GiB copy: 501 us).
_KEY_WORD_BYTES = 16
_VALUE_WORD_BYTES = 8
# Zeroing V's blocks past a sequence's end costs a store per word and index entry (a partition per sequence).
_FILL_WORD_BYTES = 16


class _Source:
    """One cache as the gathers read it: in words, permuted so that its blocks lie along ``dim``.
    ``stored_order``: the permutation back to the cache's own layout (blocks first), for ``_gather`` on
    the CPU."""

    __slots__ = ("words", "dim", "dtype", "stored_order", "on_cpu")

    def __init__(self, cache, order, word_bytes):
        self.words = _as_words(cache, word_bytes).permute(order)
        self.dim = order.index(0)
        self.dtype = cache.dtype
        self.stored_order = tuple(order.index(dim) for dim in range(len(order)))
        self.on_cpu = cache.device.type == "cpu"


def _gather(source, blocks, dtype, fp8_table):
    """The ``_Source``'s ``blocks`` in its permuted layout as a contiguous ``dtype`` tensor: one index_select
    of words, then (where needed) one conversion or, for fp8 bits, one lookup in ``fp8_table`` (vLLM's
    decoded, scaled, rounded values). On the CPU, index_select makes a strided source contiguous first, a
    copy of the whole cache per gather (torch 2.1 and 2.13: a 512-token v1 call took 0.7 s beside a 2 GB
    cache, 2 ms this way); there the blocks are picked along the cache's own first dimension, written
    through a permuted view of the result. CUDA's reads the strides: one pass as it is."""
    if source.on_cpu:
        shape = list(source.words.shape)
        shape[source.dim] = blocks.numel()
        picked = torch.empty(shape, dtype=source.words.dtype, device=blocks.device)
        torch.index_select(source.words.permute(source.stored_order), 0, blocks,
                           out=picked.permute(source.stored_order))
        picked = picked.view(source.dtype)
    else:
        picked = torch.index_select(source.words, source.dim, blocks).view(source.dtype)
    if fp8_table is not None:
        return fp8.lookup(fp8_table, picked)
    return picked if picked.dtype == dtype else picked.to(dtype)


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


class _CallIndex:
    """Index tensors shared by all tiles of a call.

    lens [seqs] int64; block_ids [seqs, partitions * columns] (clamped into [0, num_blocks));
    last_block [seqs] (table column of the last token, -1 for seq_len 0); written [seqs, partitions]
    (v2 writes these partitions); bad [seqs]; numbers: 0, 1, 2, ... int64, as long as the longest
    index range (sequences, tokens of a partition, table columns), sliced for each.
    """

    __slots__ = ("lens", "block_ids", "last_block", "written", "bad", "numbers")


def _index(call, partitions, columns):
    """The call's ``_CallIndex`` for ``partitions`` of ``columns`` table columns per sequence (see module
    docstring for what makes a sequence bad)."""
    device = call.query.device
    block_size = call.block_size
    tables = call.block_tables
    table_columns = tables.shape[1]
    index = _CallIndex()
    lens = index.lens = call.seq_lens.long()
    last_block = index.last_block = torch.div(lens - 1, block_size, rounding_mode="floor")
    index.written = torch.arange(0, partitions * columns, max(columns, 1), device=device) <= last_block[:, None]
    numbers = index.numbers = torch.arange(max(call.num_seqs, partitions * columns * block_size, table_columns),
                                           device=device)

    # Negative, over max_seq_len, or needing more blocks than the table has columns.
    bad = lens.clamp(0, min(call.max_seq_len, table_columns * block_size)) != lens
    if call.num_blocks == 0:  # nothing can be read; every sequence that needs a block is bad
        index.bad, index.block_ids = bad | (lens != 0), None
        return index
    block_ids = tables.clamp(0, call.num_blocks - 1)
    index.bad = bad | ((block_ids != tables) & (numbers[:table_columns] <= last_block[:, None])).any(dim=1)
    needed = partitions * columns  # tiles read whole partitions; missing columns are never used
    index.block_ids = block_ids[:, :needed] if table_columns >= needed else F.pad(block_ids,
                                                                                  (0, needed - table_columns))
    return index


def _boundary(call, index, seqs, parts, columns, chunk, joint=False):
    """Where each of ``seqs``' last token lies in its tile of partitions ``parts``, as tile-local positions,
    one tuple per tile of ``chunk`` sequences (a tile of one sequence where ``chunk`` is None):

        past_end [seqs, width]            its partition's tokens past the end (``joint``: every token of the
                                          tile past the end, [seqs, partitions * width])
        part_pos, block_pos [seqs]        that partition and its block among the tile's
        slot_past_end [seqs, block_size]  that block's slots past the end
        blocks_from_last [seqs * columns] that block and the ones after it in the partition

    The block holding the last token is clamped into ``parts`` (a tile wholly past the end masks
    everything, one wholly before it nothing). Split once per call: slicing per tile costs host time."""
    block_size, numbers, num_seqs = call.block_size, index.numbers, seqs.stop - seqs.start
    width, num_parts = columns * block_size, parts.stop - parts.start
    lens = index.lens[seqs]
    last_block = index.last_block[seqs].clamp(parts.start * columns, parts.stop * columns - 1)
    last_part = torch.div(last_block, columns, rounding_mode="floor")
    valid = torch.sub(lens, last_part, alpha=width)  # tokens of that partition in the sequence
    tile_seq = numbers[:num_seqs] if chunk is None or chunk >= num_seqs else numbers[:num_seqs] % chunk
    past_end = numbers[:num_parts * width] >= lens[:, None] if joint else numbers[:width] >= valid[:, None]
    part_pos = torch.add(last_part - parts.start, tile_seq, alpha=num_parts)
    block_in_part = last_block % columns
    block_pos = torch.add(block_in_part, part_pos, alpha=columns)
    slot_past_end = numbers[:block_size] >= torch.sub(valid, block_in_part, alpha=block_size)[:, None]
    blocks_from_last = torch.add(torch.maximum(numbers[:columns], block_in_part[:, None]), part_pos[:, None],
                                 alpha=columns).view(-1)
    if chunk is None or chunk >= num_seqs:
        return [(past_end, part_pos, block_pos, slot_past_end, blocks_from_last)]
    return list(zip(past_end.split(chunk), part_pos.split(chunk), block_pos.split(chunk), slot_past_end.split(chunk),
                    blocks_from_last.split(chunk * columns)))


def _tile(call, sources, index, seqs, parts, columns, mixed, scaled_tables, queries, tile_boundary, joint):
    """Per-partition (max, exp_sum, normalised float32 output) of ``seqs`` x ``parts``; with ``joint`` one
    softmax spans each sequence's partitions (max and exp_sum are then the sequence's). ``sources``: the
    caches' ``_Source`` pair; ``queries``: the call's query as [kv_heads, seqs, group, head_size] in the
    matmul dtype; ``tile_boundary()``: the tile's entry of ``_boundary``, asked for once K's gather is
    queued, so that the device gathers while the host builds it.

    Returns tensors shaped [kv_heads, chunk, tile_partitions, group] (x head_size for the output; the
    statistics of a ``joint`` softmax are the sequence's, [kv_heads, chunk, 1, group]).
    """
    device = call.query.device
    kv_heads, group, head_size = call.num_kv_heads, call.queries_per_kv, call.head_size
    block_size = call.block_size
    num_seqs, num_parts = seqs.stop - seqs.start, parts.stop - parts.start
    width = columns * block_size  # tokens per partition in this call
    batch = kv_heads * num_seqs * num_parts
    key_source, value_source = sources

    blocks = index.block_ids[seqs, parts.start * columns:parts.stop * columns].reshape(-1)
    dtype = queries.dtype  # the matmul dtype
    key_table, value_table = scaled_tables
    # K, then V: the gathered K is freed before V is gathered, so a tile holds one of them at a time.
    keys = _gather(key_source, blocks, dtype, key_table)
    past_end, part_pos, block_pos, slot_past_end, blocks_from_last = tile_boundary()
    query = queries[:, seqs, None].expand(kv_heads, num_seqs, num_parts, group, head_size).reshape(batch, group,
                                                                                                 head_size)
    logits = _bmm32(query, keys.view(batch, width, head_size).transpose(1, 2), mixed)
    del keys
    logits = logits.view(kv_heads, num_seqs, num_parts, group, width)  # q.k, float32
    scale, keep = call.scale, None
    if call.alibi_slopes is not None or call.blocksparse is not None or scale <= 0:
        logits, scale, lens = logits * scale, 1.0, index.lens[seqs]      # explicit logits
        tokens = (torch.arange(parts.start, parts.stop, device=device)[:, None] * width
                  + torch.arange(width, device=device)[None, :])         # [parts, width]
        if call.alibi_slopes is not None:
            position = (tokens[None] - lens[:, None, None] + 1).float()[None, :, :, None, :]
            logits += call.alibi_slopes.view(kv_heads, 1, 1, group, 1) * position
        if call.blocksparse is not None:
            sparse = call.blocksparse
            key_blocks = ((tokens // block_size) * block_size // sparse.block_size)[None, None, :, None, :]
            query_blocks = ((lens - 1) // sparse.block_size)[None, :, None, None, None]
            keep = ((key_blocks + _head_offsets(call, device)) % sparse.vert_stride == 0) \
                | (key_blocks > query_blocks - sparse.local_blocks)
            logits = torch.where(keep, logits, -FLT_MAX)
    if joint or num_parts == 1:  # every slot past the end, or the one partition the boundary was clamped into
        logits.masked_fill_(past_end.view(num_seqs, num_parts, 1, width), -math.inf)
    else:
        by_part = logits.view(kv_heads, num_seqs * num_parts, group, width)
        by_part.index_copy_(1, part_pos, by_part.index_select(1, part_pos).masked_fill_(past_end[:, None], -math.inf))
        del by_part

    # Otherwise the scale is folded in: max(scale * qk) = scale * max(qk) for scale > 0, and
    # exp(scale * qk - max) is one add and one exp over the tile, both in place.
    over = (2, 4) if joint else (4,)  # the softmax's tokens: the sequence's, or the partition's
    top = logits.amax(dim=over, keepdim=True).mul_(scale)
    weights = torch.add(-top, logits, alpha=scale, out=logits).exp_()
    total = weights.sum(dim=over, keepdim=True)
    probs = torch.empty(weights.shape, dtype=call.query.dtype, device=device)
    torch.mul(weights, (total + 1e-6).reciprocal_(), out=probs)  # vLLM rounds p to the query dtype
    del logits, weights  # (views of the float32 logits)
    if keep is not None:  # skipped tokens count in the sum but their V is never read
        probs.masked_fill_(~keep, 0)

    values = _gather(value_source, blocks, dtype, value_table)  # [head_size, kv_heads, tile blocks, block_size]
    boundary_values = values.index_select(2, block_pos).masked_fill_(slot_past_end, 0)  # 0 * NaN is NaN
    _as_words(values, _FILL_WORD_BYTES).index_fill_(2, blocks_from_last, 0)
    values.index_copy_(2, block_pos, boundary_values)
    outputs = _bmm32(probs.view(batch, group, width), values.view(head_size, batch, width).permute(1, 2, 0), mixed)
    return top.squeeze(4), total.squeeze(4), outputs.view(kv_heads, num_seqs, num_parts, group, head_size)


def _by_kv_head(tensor, kv_heads):
    """[seqs, heads, partitions, ...] -> its [kv_heads, seqs, partitions, group, ...] view (the tiles' order)."""
    tensor = tensor.unflatten(1, (kv_heads, -1))
    return tensor.permute(1, 0, 3, 2, *range(4, tensor.dim()))


def _reduce(call, index, seqs, top, total, outputs, joint):
    """Write one chunk's partition results (``_tile``'s layout): v2's per-partition outputs, then ``out``
    (``joint``: the partitions share one softmax, so their outputs add up)."""
    kv_heads, partitions = call.num_kv_heads, outputs.shape[2]
    written = index.written[seqs]
    seq_written, seq_bad = written[:, :, None], index.bad[seqs][:, None, None]  # against [kv, seqs, parts, G]
    if call.is_v2:
        top.masked_fill_(seq_bad, math.nan)
        total.masked_fill_(seq_bad, math.nan)
        outputs.masked_fill_(seq_bad[..., None], math.nan)
        for buffer, values in ((call.max_logits, top), (call.exp_sums, total), (call.tmp_out, outputs)):
            region = _by_kv_head(buffer[seqs, :, :partitions], kv_heads)
            mask = seq_written if values.dim() == 4 else seq_written[..., None]
            region.copy_(torch.where(mask, values, region))  # tmp_out: rounded to the query dtype
        outputs.copy_(_by_kv_head(call.tmp_out[seqs, :, :partitions], kv_heads))  # vLLM's reduce reads tmp_out

    if partitions == 1:  # a single partition is copied
        reduced = torch.where(written[:, :1, None], outputs[:, :, 0], 0.0)
    elif joint:  # partitions past the end hold p = 0 times whatever V their blocks held: left out
        reduced = torch.where(seq_written[..., None], outputs, 0.0).sum(dim=2)
    else:  # vLLM's reduce: w_p = exp_sum_p * exp(max_p - max), out = sum_p out_p * w_p / (sum_p w_p + 1e-6)
        best = torch.where(seq_written, top, -math.inf).amax(dim=2, keepdim=True)
        rescaled = torch.where(seq_written, total * torch.exp(top - best), 0.0)
        rescaled.mul_((rescaled.sum(dim=2, keepdim=True) + 1e-6).reciprocal_())
        # One written partition: weight exactly 1 (copied); none (seq_len 0): 0. Unwritten ones may hold NaN.
        weights = torch.where(written[:, 1, None, None], rescaled, seq_written)
        reduced = outputs.masked_fill_(~seq_written[..., None], 0.0).mul_(weights[..., None]).sum(dim=2)
    call.out[seqs].unflatten(1, (kv_heads, -1)).transpose(0, 1).copy_(torch.where(seq_bad, math.nan, reduced))


def _write_unread(call, index):
    """The outputs of a call that can read nothing (no partitions or no blocks): zeros, NaN for bad sequences."""
    call.out.copy_(torch.where(index.bad[:, None, None], math.nan, 0.0).expand(call.out.shape))
    if call.is_v2:
        bad_written = (index.written & index.bad[:, None])[:, None, :]
        for buffer in (call.max_logits, call.exp_sums, call.tmp_out):
            region = buffer[:, :, :call.max_num_partitions]
            mask = bad_written if buffer.dim() == 3 else bad_written[..., None]
            region.copy_(torch.where(mask, math.nan, region))


def forward(call):
    """Run one validated decode call (``contract.DecodeCall``), writing its outputs in place."""
    num_seqs = call.num_seqs
    if num_seqs == 0:
        return
    if call.max_num_partitions == 0 or call.num_blocks == 0:  # nothing can be read: zeros, NaN for bad sequences
        _write_unread(call, _index(call, call.max_num_partitions, _columns(call)))
        return
    compute_dtype = call.query.dtype
    mixed = _bmm_float32_out(call.query.device, compute_dtype)
    plan = _plan(call, mixed)
    partitions, columns, chunk, tile_parts = plan.partitions, plan.columns, plan.chunk, plan.tile_parts
    joint = plan.joint
    matmul_dtype = compute_dtype if mixed else torch.float32  # float32 where bmm cannot take half inputs
    index = _index(call, partitions, columns)

    scaled_tables = (None, None)
    if call.kv_cache_dtype != "auto":
        # Where the matmuls upcast anyway, decode straight to float32 (rounded to the query dtype first).
        scaled_tables = tuple(fp8.scaled_table(call.kv_cache_dtype, scale, compute_dtype, call.query.device)
                              .to(matmul_dtype) for scale in (call.k_scale, call.v_scale))
    key_cache, value_cache = _caches(call)
    sources = (_Source(key_cache, _KEY_ORDER, _KEY_WORD_BYTES), _Source(value_cache, _VALUE_ORDER, _VALUE_WORD_BYTES))
    kv_heads, group, head_size = call.num_kv_heads, call.queries_per_kv, call.head_size
    queries = call.query.unflatten(1, (kv_heads, group)).transpose(0, 1).to(matmul_dtype)
    reduced = _reduce_group(call, plan)
    boundaries = []

    def tile_boundary(seqs, parts):
        if tile_parts < partitions:  # a sequence over several tiles: each tile's own
            return _boundary(call, index, seqs, parts, columns, None)[0]
        if not boundaries:  # tiles of whole sequences: all tiles' at once, at the first tile
            boundaries.extend(_boundary(call, index, slice(0, num_seqs), slice(0, partitions), columns, chunk, joint))
        return boundaries[seqs.start // chunk]

    buffers = None
    if reduced > chunk or tile_parts < partitions:  # several tiles' results, reduced together
        stats_shape = (kv_heads, reduced, partitions, group)
        buffers = (torch.empty(stats_shape, device=call.query.device),
                   torch.empty(stats_shape, device=call.query.device),
                   torch.empty(*stats_shape, head_size, device=call.query.device))
    for group_start in range(0, num_seqs, reduced):
        group_stop = min(group_start + reduced, num_seqs)
        if buffers is None:
            seqs, parts = slice(group_start, group_stop), slice(0, partitions)
            results = _tile(call, sources, index, seqs, parts, columns, mixed, scaled_tables, queries,
                            functools.partial(tile_boundary, seqs, parts), joint)
        else:
            results = tuple(buffer[:, :group_stop - group_start] for buffer in buffers)
            for start in range(group_start, group_stop, chunk):
                seqs = slice(start, min(start + chunk, group_stop))
                rows = slice(seqs.start - group_start, seqs.stop - group_start)
                for first in range(0, partitions, tile_parts):  # one run unless a sequence is over a tile
                    parts = slice(first, min(first + tile_parts, partitions))
                    for result, tile_result in zip(results, _tile(call, sources, index, seqs, parts, columns, mixed,
                                                                   scaled_tables, queries,
                                                                   functools.partial(tile_boundary, seqs, parts),
                                                                   joint)):
                        result[:, rows, parts] = tile_result
        _reduce(call, index, slice(group_start, group_stop), *results, joint)
