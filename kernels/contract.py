"""vLLM's paged-attention op contract: what the arguments may be, checked before anything is written.

Both backends take a ``DecodeCall`` made by ``check_call``; every rejected argument raises a
``ValueError`` that names the argument and what is allowed.

Layouts (vLLM's)::

    query        [num_seqs, num_heads, head_size]                 float32 | float16 | bfloat16
    key_cache    [num_blocks, num_kv_heads, head_size // x, block_size, x]   x = 16 // element size
    value_cache  [num_blocks, num_kv_heads, head_size, block_size]
    block_tables [num_seqs, max_blocks_per_seq] int32;  seq_lens [num_seqs] int32
    v2 only: exp_sums, max_logits [num_seqs, num_heads, max_partitions] float32,
             tmp_out [num_seqs, num_heads, max_partitions, head_size] query dtype
"""

import math

import torch

PARTITION_SIZE = 512
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
# vLLM's names for the cache formats, mapped to the one we compute with ("fp8" is e4m3 on CUDA).
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_FP8_STORAGE = {
    "fp8_e4m3": (torch.uint8,) + tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None),
    "fp8_e5m2": (torch.uint8,) + tuple(d for d in (getattr(torch, "float8_e5m2", None),) if d is not None),
}


class BlockSparse:
    """vLLM's block-sparse pattern (active when vert_stride > 1)."""

    __slots__ = ("local_blocks", "vert_stride", "block_size", "head_sliding_step", "tp_rank")

    def __init__(self, local_blocks, vert_stride, block_size, head_sliding_step, tp_rank):
        self.local_blocks = local_blocks
        self.vert_stride = vert_stride
        self.block_size = block_size
        self.head_sliding_step = head_sliding_step
        self.tp_rank = tp_rank


class DecodeCall:
    """One validated decode call; ``exp_sums`` is None for v1."""

    __slots__ = ("out", "query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables",
                 "seq_lens", "block_size", "max_seq_len", "alibi_slopes", "kv_cache_dtype", "k_scale",
                 "v_scale", "blocksparse", "exp_sums", "max_logits", "tmp_out",
                 "num_seqs", "num_heads", "head_size", "num_blocks", "x", "max_num_partitions", "device")

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)

    @property
    def is_v2(self):
        return self.exp_sums is not None

    @property
    def queries_per_kv(self):
        return self.num_heads // self.num_kv_heads


_TENSOR = torch.Tensor
_INT32 = torch.int32
_FLOAT32 = torch.float32


def _fail(argument, allowed, got):
    raise ValueError(f"{argument}: {allowed}; got {got}")


def _tensor(name, value, ndim):
    if not isinstance(value, torch.Tensor):
        _fail(name, "must be a torch.Tensor", type(value).__name__)
    if value.dim() != ndim:
        _fail(name, f"must have {ndim} dimensions", f"shape {tuple(value.shape)}")
    return value


def _int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, f"must be an int >= {minimum}", repr(value))
    return value


def _scalar_scale(name, value, device):
    """vLLM <= 0.6.6 passes a float, >= 0.7 a one-element float32 tensor on the device."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32:
            _fail(name, "must be a float or a one-element float32 tensor",
                  f"{value.dtype} tensor of shape {tuple(value.shape)}")
        if value.device != device and value.device.type != "cpu":
            _fail(name, f"must be on the query's device {device} (or the CPU)", str(value.device))
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, "must be a finite float or a one-element float32 tensor", repr(value))
    return float(value)


def check_call(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
               blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
               blocksparse_head_sliding_step=0, exp_sums=None, max_logits=None, tmp_out=None):
    """Validate one v1 call (``exp_sums`` None) or v2 call and return its ``DecodeCall``.

    This runs on every decode step, so the common case (plain tensors, ints and floats) is tested with
    ``type(...) is`` and compares before any helper is called; the helpers then name what is wrong.
    """
    if type(query) is not _TENSOR or query.dim() != 3:
        _tensor("query", query, 3)
    dtype = query.dtype
    if dtype not in QUERY_DTYPES:
        _fail("query", "dtype must be float32, float16 or bfloat16", str(dtype))
    shape = query.shape
    num_seqs, num_heads, head_size = shape
    if head_size not in HEAD_SIZES:
        _fail("query", f"head size must be one of {HEAD_SIZES}", head_size)

    if type(out) is not _TENSOR or out.dim() != 3:
        _tensor("out", out, 3)
    if out.shape != shape or out.dtype != dtype:
        _fail("out", f"must match query ({tuple(shape)}, {dtype})", f"{tuple(out.shape)}, {out.dtype}")

    cache_format = KV_CACHE_DTYPES.get(kv_cache_dtype) if type(kv_cache_dtype) is str else None
    if cache_format is None:
        _fail("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}", repr(kv_cache_dtype))
    if type(block_size) is not int or block_size < 1:
        _int("block_size", block_size, 1)
    if block_size not in BLOCK_SIZES:
        _fail("block_size", f"must be one of {BLOCK_SIZES}", block_size)
    if type(num_kv_heads) is not int or num_kv_heads < 1:
        _int("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads:
        _fail("num_kv_heads", f"must divide the query's num_heads ({num_heads})", num_kv_heads)

    if type(key_cache) is not _TENSOR or key_cache.dim() != 5:
        _tensor("key_cache", key_cache, 5)
    if type(value_cache) is not _TENSOR or value_cache.dim() != 4:
        _tensor("value_cache", value_cache, 4)
    cache_dtype = key_cache.dtype
    if cache_format == "auto":
        if cache_dtype != dtype or value_cache.dtype != dtype:
            _check_cache_dtypes(key_cache, value_cache, (dtype,), kv_cache_dtype)
    elif cache_dtype not in _FP8_STORAGE[cache_format] or value_cache.dtype != cache_dtype:
        _check_cache_dtypes(key_cache, value_cache, _FP8_STORAGE[cache_format], kv_cache_dtype)
    x = 16 // key_cache.element_size()
    if head_size % x:
        _fail("kv_cache_dtype", f"{kv_cache_dtype!r} packs {x} dims per 16 bytes: head size must be a multiple of {x}",
              f"head size {head_size}")
    key_shape = key_cache.shape
    num_blocks = key_shape[0]
    expected_key = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    if key_shape != expected_key:
        _fail("key_cache", f"shape must be [num_blocks, num_kv_heads, head_size/x, block_size, x] = {expected_key}",
              tuple(key_shape))
    expected_value = (num_blocks, num_kv_heads, head_size, block_size)
    if value_cache.shape != expected_value:
        _fail("value_cache", f"shape must be [num_blocks, num_kv_heads, head_size, block_size] = {expected_value}",
              tuple(value_cache.shape))

    if type(block_tables) is not _TENSOR or block_tables.dim() != 2:
        _tensor("block_tables", block_tables, 2)
    if block_tables.dtype != _INT32 or block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"must be int32 of shape [{num_seqs}, max_blocks_per_seq]",
              f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if type(seq_lens) is not _TENSOR or seq_lens.dim() != 1:
        _tensor("seq_lens", seq_lens, 1)
    if seq_lens.dtype != _INT32 or seq_lens.shape[0] != num_seqs:
        _fail("seq_lens", f"must be int32 of shape [{num_seqs}]", f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if type(max_seq_len) is not int or max_seq_len < 0:
        _int("max_seq_len", max_seq_len, 0)
    if alibi_slopes is not None:
        alibi_slopes = _tensor("alibi_slopes", alibi_slopes, 1)
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape[0] != num_heads:
            _fail("alibi_slopes", f"must be None or float32 of shape [{num_heads}]",
                  f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
    if type(scale) is not float or not math.isfinite(scale):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            _fail("scale", "must be a finite float", repr(scale))
        scale = float(scale)
    device = query.device
    if type(k_scale) is not float or not math.isfinite(k_scale):
        k_scale = _scalar_scale("k_scale", k_scale, device)
    if type(v_scale) is not float or not math.isfinite(v_scale):
        v_scale = _scalar_scale("v_scale", v_scale, device)

    max_num_partitions = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    v2 = exp_sums is not None or max_logits is not None or tmp_out is not None
    if v2 and not (type(exp_sums) is _TENSOR and type(max_logits) is _TENSOR and type(tmp_out) is _TENSOR
                   and exp_sums.dtype == _FLOAT32 and max_logits.dtype == _FLOAT32 and tmp_out.dtype == dtype
                   and exp_sums.dim() == 3 and exp_sums.shape[2] >= max_num_partitions
                   and exp_sums.shape == (num_seqs, num_heads, exp_sums.shape[2]) == max_logits.shape
                   and tmp_out.shape == (num_seqs, num_heads, exp_sums.shape[2], head_size)):
        _check_v2_buffers(query, num_seqs, num_heads, head_size, max_num_partitions, exp_sums, max_logits, tmp_out)

    # get_device() (an int: the CUDA index, -1 for the CPU, meta, ...) is cheaper than comparing torch.device
    # objects; the named loop runs only where that cannot decide.
    device_index = query.get_device()
    if device_index < 0 or out.get_device() != device_index or key_cache.get_device() != device_index \
            or value_cache.get_device() != device_index or block_tables.get_device() != device_index \
            or seq_lens.get_device() != device_index or alibi_slopes is not None \
            or (v2 and (exp_sums.get_device() != device_index or max_logits.get_device() != device_index
                        or tmp_out.get_device() != device_index)):
        _check_devices(device, device_index, out=out, key_cache=key_cache, value_cache=value_cache,
                       block_tables=block_tables, seq_lens=seq_lens, alibi_slopes=alibi_slopes, exp_sums=exp_sums,
                       max_logits=max_logits, tmp_out=tmp_out)

    if type(tp_rank) is not int or tp_rank < 0:
        _int("tp_rank", tp_rank, 0)
    blocksparse = None
    if type(blocksparse_vert_stride) is not int or blocksparse_vert_stride > 1 or blocksparse_vert_stride < 0:
        blocksparse = _check_blocksparse(block_size, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                                         blocksparse_block_size, blocksparse_head_sliding_step)

    # Plain attribute stores: DecodeCall(**fields) would cost several microseconds of launch overhead.
    call = object.__new__(DecodeCall)
    call.out, call.query, call.key_cache, call.value_cache = out, query, key_cache, value_cache
    call.num_kv_heads, call.scale, call.block_tables, call.seq_lens = num_kv_heads, scale, block_tables, seq_lens
    call.block_size, call.max_seq_len, call.alibi_slopes = block_size, max_seq_len, alibi_slopes
    call.kv_cache_dtype, call.k_scale, call.v_scale, call.blocksparse = cache_format, k_scale, v_scale, blocksparse
    call.exp_sums, call.max_logits, call.tmp_out = exp_sums, max_logits, tmp_out
    call.num_seqs, call.num_heads, call.head_size, call.num_blocks = num_seqs, num_heads, head_size, num_blocks
    call.x, call.max_num_partitions, call.device = x, max_num_partitions, device
    return call


def _check_cache_dtypes(key_cache, value_cache, allowed, kv_cache_dtype):
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype not in allowed:
            _fail(name, f"dtype must be {' or '.join(map(str, allowed))} for kv_cache_dtype={kv_cache_dtype!r}",
                  str(cache.dtype))
    if key_cache.dtype != value_cache.dtype:
        _fail("value_cache", f"dtype must match key_cache ({key_cache.dtype})", str(value_cache.dtype))


def _check_v2_buffers(query, num_seqs, num_heads, head_size, max_num_partitions, exp_sums, max_logits, tmp_out):
    expected = (num_seqs, num_heads)
    for name, buffer in (("exp_sums", exp_sums), ("max_logits", max_logits)):
        buffer = _tensor(name, buffer, 3)
        if buffer.dtype != torch.float32 or buffer.shape[:2] != expected or buffer.shape[2] < max_num_partitions:
            _fail(name, f"must be float32 of shape [{num_seqs}, {num_heads}, >= {max_num_partitions}]",
                  f"{buffer.dtype} {tuple(buffer.shape)}")
    tmp_out = _tensor("tmp_out", tmp_out, 4)
    if tmp_out.dtype != query.dtype or tmp_out.shape[:2] != expected \
            or tmp_out.shape[2] < max_num_partitions or tmp_out.shape[3] != head_size:
        _fail("tmp_out", f"must be {query.dtype} of shape [{num_seqs}, {num_heads}, >= {max_num_partitions}, "
              f"{head_size}]", f"{tmp_out.dtype} {tuple(tmp_out.shape)}")
    if exp_sums.shape != max_logits.shape or tmp_out.shape[2] != exp_sums.shape[2]:
        _fail("tmp_out", "exp_sums, max_logits and tmp_out must agree on the partition count",
              f"{tuple(exp_sums.shape)}, {tuple(max_logits.shape)}, {tuple(tmp_out.shape)}")


def _check_devices(device, device_index, **tensors):
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.get_device() != device_index
                                   or (device_index < 0 and tensor.device != device)):
            _fail(name, f"must be on the query's device {device}", str(tensor.device))


def _check_blocksparse(block_size, tp_rank, local_blocks, vert_stride, sparse_block_size, head_sliding_step):
    """The block-sparse pattern (vLLM's, active for vert_stride > 1), or None."""
    if _int("blocksparse_vert_stride", vert_stride, 0) <= 1:
        return None
    _int("blocksparse_local_blocks", local_blocks, 0)
    _int("blocksparse_block_size", sparse_block_size, 1)
    if isinstance(head_sliding_step, bool) or not isinstance(head_sliding_step, int):
        _fail("blocksparse_head_sliding_step", "must be an int", repr(head_sliding_step))
    if sparse_block_size % block_size:
        _fail("blocksparse_block_size", f"must be a multiple of block_size ({block_size})", sparse_block_size)
    return BlockSparse(local_blocks, vert_stride, sparse_block_size, head_sliding_step, tp_rank)


def check_table_entries(call):
    """The expensive checks (``BIV100_PATCH_VALIDATE=1``): every used block-table entry and sequence length.

    Reads seq_lens and block_tables back to the host, so it synchronises with the device.
    """
    seq_lens = call.seq_lens.to("cpu", torch.int64)
    if call.num_seqs == 0:
        return
    if int(seq_lens.min()) < 0:
        _fail("seq_lens", "entries must be >= 0", int(seq_lens.min()))
    longest = int(seq_lens.max())
    if longest > call.max_seq_len:
        _fail("seq_lens", f"entries must be <= max_seq_len ({call.max_seq_len})", longest)
    used_blocks = (seq_lens + call.block_size - 1) // call.block_size
    if int(used_blocks.max()) > call.block_tables.shape[1]:
        _fail("block_tables", f"must have a column for every used block ({int(used_blocks.max())})",
              call.block_tables.shape[1])
    tables = call.block_tables.to("cpu", torch.int64)
    columns = torch.arange(tables.shape[1]).unsqueeze(0)
    used = columns < used_blocks.unsqueeze(1)
    bad = used & ((tables < 0) | (tables >= call.num_blocks))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        _fail("block_tables", f"used entries must lie in [0, {call.num_blocks})",
              f"block_tables[{seq}, {col}] = {int(tables[seq, col])}")
