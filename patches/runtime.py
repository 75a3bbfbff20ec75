"""The ops the patch installs: the chosen backend, with a per-shape fallback to the PyTorch backend.

Arguments are validated once (``contract.check_call``) before any kernel runs, so a ``ValueError``
from bad input reaches the caller unchanged. Anything the Triton backend raises after that is
its own failure (a compile error for a shape the probe did not try, a launch failure): the
shape is routed to the PyTorch backend from then on, the call is redone there so the caller
gets a correct result, one WARNING is logged and the event is recorded. ``BIV100_PATCH_STRICT=1``
re-raises instead.
"""

import logging
import threading

from biv100_patch import kernels
from biv100_patch.kernels import contract

logger = logging.getLogger("biv100_patch")


def shape_key(call):
    """What a Triton kernel is specialised on: a failure for one key says nothing about another."""
    return ("v2" if call.is_v2 else "v1", str(call.query.dtype).replace("torch.", ""), call.head_size,
            call.block_size, call.kv_cache_dtype, call.queries_per_kv, call.alibi_slopes is not None,
            call.blocksparse is not None, call.query.device.type)


def _strict():
    from biv100_patch.probe import settings
    try:
        return settings.strict()
    except settings.SettingsError as error:
        logger.warning("biv100-patch: %s; falling back as if BIV100_PATCH_STRICT=0", error)
        return False


def _record_event(event):
    """Add ``event`` to the decision record; a record that cannot be written never fails the call."""
    try:
        from biv100_patch import probe
        probe.record_runtime_event(event)
    except Exception as error:  # the record is a report: losing one entry must not break decoding
        logger.debug("biv100-patch: could not record %s: %r", event.get("event"), error)


class PatchedOps:
    """vLLM's two ops (the backend signature) over ``primary``, falling back to ``torch`` per shape.

    ``primary`` and ``fallback`` are ``kernels.PagedAttentionBackend`` objects (their ``forward``
    takes a validated ``DecodeCall``); ``fallback`` is made on first need.
    """

    def __init__(self, primary, validate_tables=False, record_event=_record_event, make_backend=None):
        self.primary = primary
        self.validate_tables = validate_tables
        self.routed = {}   # shape key -> "ErrorType: message" of the failure that routed it to torch
        self._fallback = primary if primary.name == "torch" else None
        self._lock = threading.Lock()
        self._record_event = record_event
        self._make_backend = make_backend or kernels.get_backend

    @property
    def name(self):
        return self.primary.name

    def __repr__(self):
        return f"<biv100-patch ops: {self.primary.name}, {len(self.routed)} shape(s) routed to torch>"

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

    def _run(self, call):
        if self.validate_tables:
            contract.check_table_entries(call)
        if self._fallback is self.primary:
            self.primary.forward(call)
            return
        if self.routed:  # the shape key costs microseconds per call: only once something was routed
            key = shape_key(call)
            if key in self.routed:
                self._fallback.forward(call)
                return
        try:
            self.primary.forward(call)
        except Exception as error:
            if _strict():
                raise
            self._route_to_torch(shape_key(call), error).forward(call)

    def _route_to_torch(self, key, error):
        with self._lock:
            if self._fallback is None:
                self._fallback = self._make_backend("torch", validate_tables=self.validate_tables)
            if key in self.routed:  # another thread got there first: its warning covers this shape
                return self._fallback
            self.routed[key] = f"{type(error).__name__}: {error}"
        shape = dict(zip(("op", "dtype", "head_size", "block_size", "kv_cache_dtype", "queries_per_kv", "alibi",
                          "blocksparse", "device"), key))
        logger.warning("biv100-patch: the %s backend failed on %s (%s: %s); this shape uses the torch backend "
                       "from now on", self.primary.name, shape, type(error).__name__, str(error)[:500])
        self._record_event({"event": "runtime_fallback", "from": self.primary.name, "to": "torch",
                            "shape": shape, "error": f"{type(error).__name__}: {str(error)[:2000]}"})
        return self._fallback

    def routed_shapes(self):
        with self._lock:
            return dict(self.routed)
