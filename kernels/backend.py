"""The backend object: vLLM's two op signatures in front of one validated forward function."""

from . import contract

BACKEND_NAMES = ("triton", "torch")


class PagedAttentionBackend:
    """vLLM's ``paged_attention_v1``/``_v2`` over ``forward(call: contract.DecodeCall) -> None``.

    Arguments are checked (``contract.check_call``) before anything is written; with
    ``validate_tables`` the block tables and sequence lengths are checked on every call too.
    """

    def __init__(self, name, forward, validate_tables=False):
        self.name = name
        self.forward = forward
        self.validate_tables = validate_tables

    def __repr__(self):
        return f"<PagedAttentionBackend {self.name}>"

    def _run(self, call):
        if self.validate_tables:
            contract.check_table_entries(call)
        self.forward(call)

    def paged_attention_v1(self, out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                           blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                           blocksparse_head_sliding_step=0):
        self._run(contract.check_call(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
            blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step))

    def paged_attention_v2(self, out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                           scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                           k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                           blocksparse_block_size=64, blocksparse_head_sliding_step=0):
        self._run(contract.check_call(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
            blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step,
            exp_sums=exp_sum, max_logits=max_logits, tmp_out=tmp_out))


def get_backend(name, *, limits=None, validate_tables=False, excluded=()):
    """The backend called ``name`` ("triton" or "torch").

    ``limits`` (a ``limits.DeviceLimits``) bounds the Triton configs; left out, they are read
    from the tensors' device at the first call. ``excluded``: the Triton kernel variants
    (``configs.attention_key`` lists) whose calls it refuses, raising ``VariantExcluded``.
    """
    if name == "torch":
        from .paged_attention_torch import forward
        return PagedAttentionBackend("torch", forward, validate_tables)
    if name == "triton":
        from .paged_attention_triton import make_forward
        return PagedAttentionBackend("triton", make_forward(limits, excluded), validate_tables)
    raise ValueError(f"name: must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
