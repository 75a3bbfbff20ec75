"""Bad input to the ops: a ValueError that names the argument, raised before anything is written.

Each case changes one argument of a valid call; the output buffers are filled with a sentinel
beforehand and must be bit-for-bit unchanged afterwards. The 'meta' device stands in for a second
device. The same checks guard both backends (they run in ``contract.check_call``).
"""

import math

import pytest
import torch

from kernels import contract, get_backend
from tests import golden

BACKEND = get_backend("torch")
SENTINEL = 7.0


def _valid_inputs(kv_cache_dtype="auto", head_size=64, alibi=True):
    return golden.random_case(torch.float16, head_size, 16, 4, 2, [5, 600], alibi=alibi, kv_cache_dtype=kv_cache_dtype)


def _buffers(inputs):
    buffers = golden.nan_buffers(inputs, "v2", "cpu")
    for tensor in buffers.values():
        tensor.fill_(SENTINEL)
    return buffers


def _replace(**changes):
    def change(inputs, buffers):
        for key, value in changes.items():
            value = value(inputs, buffers) if callable(value) else value
            (buffers if key in buffers else inputs)[key] = value
    return change


def _meta(key):
    return _replace(**{key: lambda inputs, buffers: (buffers.get(key, inputs.get(key))).to("meta")})


BAD_INPUTS = [
    # (case id, the argument the error must name, the change)
    ("query-float64", "query", _replace(query=lambda i, b: i["query"].double())),
    ("query-int", "query", _replace(query=lambda i, b: i["query"].to(torch.int32))),
    ("query-2d", "query", _replace(query=lambda i, b: i["query"][0])),
    ("query-head-size-48", "query", _replace(query=lambda i, b: i["query"][:, :, :48])),
    ("out-shape", "out", _replace(out=lambda i, b: b["out"][:1])),
    ("out-dtype", "out", _replace(out=lambda i, b: b["out"].bfloat16())),
    ("key-cache-dtype", "key_cache", _replace(key_cache=lambda i, b: i["key_cache"].float())),
    ("value-cache-dtype", "value_cache", _replace(value_cache=lambda i, b: i["value_cache"].bfloat16())),
    ("key-cache-layout", "key_cache", _replace(key_cache=lambda i, b: i["key_cache"].reshape(-1, 2, 16, 16, 4))),
    ("key-cache-heads", "key_cache", _replace(key_cache=lambda i, b: i["key_cache"][:, :1])),
    ("value-cache-blocks", "value_cache", _replace(value_cache=lambda i, b: i["value_cache"][:-1])),
    ("value-cache-block-size", "value_cache", _replace(value_cache=lambda i, b: i["value_cache"][..., :8])),
    ("block-size-64", "block_size", _replace(block_size=64)),
    ("block-size-vs-cache", "key_cache", _replace(block_size=32)),
    ("block-size-float", "block_size", _replace(block_size=16.0)),
    ("block-tables-int64", "block_tables", _replace(block_tables=lambda i, b: i["block_tables"].long())),
    ("block-tables-rows", "block_tables", _replace(block_tables=lambda i, b: i["block_tables"][:1])),
    ("block-tables-1d", "block_tables", _replace(block_tables=lambda i, b: i["block_tables"][0])),
    ("seq-lens-int64", "seq_lens", _replace(seq_lens=lambda i, b: i["seq_lens"].long())),
    ("seq-lens-length", "seq_lens", _replace(seq_lens=lambda i, b: i["seq_lens"][:1])),
    ("seq-lens-list", "seq_lens", _replace(seq_lens=[5, 600])),
    ("kv-cache-dtype-int8", "kv_cache_dtype", _replace(kv_cache_dtype="int8")),
    ("kv-cache-dtype-none", "kv_cache_dtype", _replace(kv_cache_dtype=None)),
    ("fp8-with-half-caches", "key_cache", _replace(kv_cache_dtype="fp8")),
    ("num-kv-heads-3", "num_kv_heads", _replace(num_kv_heads=3)),
    ("num-kv-heads-0", "num_kv_heads", _replace(num_kv_heads=0)),
    ("num-kv-heads-8", "num_kv_heads", _replace(num_kv_heads=8)),
    ("alibi-dtype", "alibi_slopes", _replace(alibi_slopes=lambda i, b: i["alibi_slopes"].half())),
    ("alibi-length", "alibi_slopes", _replace(alibi_slopes=lambda i, b: i["alibi_slopes"][:2])),
    ("scale-nan", "scale", _replace(scale=math.nan)),
    ("scale-str", "scale", _replace(scale="0.125")),
    ("k-scale-float64-tensor", "k_scale", _replace(k_scale=torch.tensor([1.0], dtype=torch.float64))),
    ("k-scale-two-elements", "k_scale", _replace(k_scale=torch.ones(2))),
    ("v-scale-inf", "v_scale", _replace(v_scale=math.inf)),
    ("max-seq-len-negative", "max_seq_len", _replace(max_seq_len=-1)),
    ("max-seq-len-float", "max_seq_len", _replace(max_seq_len=600.0)),
    ("exp-sums-dtype", "exp_sums", _replace(exp_sums=lambda i, b: b["exp_sums"].half())),
    ("max-logits-partitions", "max_logits", _replace(max_logits=lambda i, b: b["max_logits"][:, :, :1])),
    ("tmp-out-dtype", "tmp_out", _replace(tmp_out=lambda i, b: b["tmp_out"].float())),
    ("tmp-out-head-size", "tmp_out", _replace(tmp_out=lambda i, b: b["tmp_out"][..., :32])),
    ("tmp-out-partitions", "tmp_out",
     _replace(tmp_out=lambda i, b: torch.cat([b["tmp_out"], b["tmp_out"][:, :, :1]], dim=2))),
    ("key-cache-other-device", "key_cache", _meta("key_cache")),
    ("value-cache-other-device", "value_cache", _meta("value_cache")),
    ("block-tables-other-device", "block_tables", _meta("block_tables")),
    ("seq-lens-other-device", "seq_lens", _meta("seq_lens")),
    ("alibi-other-device", "alibi_slopes", _meta("alibi_slopes")),
    ("out-other-device", "out", _meta("out")),
    ("exp-sums-other-device", "exp_sums", _meta("exp_sums")),
    ("tmp-out-other-device", "tmp_out", _meta("tmp_out")),
    ("k-scale-other-device", "k_scale", _replace(k_scale=torch.ones(1, device="meta"))),
    ("tp-rank-negative", "tp_rank", _replace(tp_rank=-1)),
    ("blocksparse-block-size", "blocksparse_block_size",
     _replace(blocksparse_vert_stride=2, blocksparse_block_size=24)),
    ("blocksparse-sliding-step", "blocksparse_head_sliding_step",
     _replace(blocksparse_vert_stride=2, blocksparse_head_sliding_step=1.5)),
]
TAIL = ("tp_rank", "blocksparse_local_blocks", "blocksparse_vert_stride", "blocksparse_block_size",
        "blocksparse_head_sliding_step")


def _call(version, inputs, buffers):
    tail = {key: inputs.pop(key) for key in TAIL if key in inputs}
    golden.call_op(BACKEND, version, buffers, inputs, **tail)


V2_ONLY = ("exp_sums", "max_logits", "tmp_out")
BAD_CALLS = [pytest.param(version, argument, change, id=f"{version}-{case_id}")
             for case_id, argument, change in BAD_INPUTS for version in golden.VERSIONS
             if version == "v2" or argument not in V2_ONLY]


@pytest.mark.parametrize("version,argument,change", BAD_CALLS)
def test_bad_input_is_rejected_before_writing(version, argument, change):
    inputs = _valid_inputs()
    originals = _buffers(inputs)
    buffers = dict(originals)
    change(inputs, buffers)
    with pytest.raises(ValueError) as error:
        _call(version, inputs, buffers)
    assert str(error.value).startswith(f"{argument}: "), str(error.value)
    assert "got" in str(error.value)
    for name, tensor in originals.items():
        if tensor.device.type != "meta":
            assert (tensor == SENTINEL).all(), f"{name} was written"


def test_valid_base_call_is_accepted():
    """The base of every bad-input case really is valid (so each case tests exactly one change)."""
    inputs = _valid_inputs()
    for version in golden.VERSIONS:
        buffers = _buffers(inputs)
        _call(version, dict(inputs), buffers)
        assert not (buffers["out"] == SENTINEL).all()


def test_head_size_not_a_multiple_of_fp8_packing():
    inputs = _valid_inputs(kv_cache_dtype="fp8", head_size=64, alibi=False)
    inputs["query"] = torch.zeros(2, 4, 120, dtype=torch.float16)
    inputs["key_cache"] = torch.zeros(inputs["key_cache"].shape[0], 2, 7, 16, 16, dtype=torch.uint8)
    inputs["value_cache"] = torch.zeros(inputs["key_cache"].shape[0], 2, 120, 16, dtype=torch.uint8)
    out = torch.full((2, 4, 120), SENTINEL, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: .*multiple of 16"):
        BACKEND.paged_attention_v1(out, *golden.op_arguments(inputs))
    assert (out == SENTINEL).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_as_float8_tensors(fmt):
    dtype = getattr(torch, {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[fmt], None)
    if dtype is None:
        pytest.skip("this torch has no float8 dtypes")
    inputs = golden.random_case(torch.bfloat16, 64, 16, 4, 2, [5, 600], kv_cache_dtype=fmt, k_scale=0.5)
    expected = golden.run_op(BACKEND, inputs, "v2", "cpu")
    inputs["key_cache"] = inputs["key_cache"].view(dtype)
    inputs["value_cache"] = inputs["value_cache"].view(dtype)
    actual = golden.run_op(BACKEND, inputs, "v2", "cpu")
    assert torch.equal(actual["out"], expected["out"])
    inputs["value_cache"] = inputs["value_cache"].view(torch.uint8).view(
        torch.float8_e5m2 if fmt == "fp8_e4m3" else torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^value_cache: "):
        golden.run_op(BACKEND, inputs, "v2", "cpu")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="^name: must be one of triton, torch"):
        get_backend("cuda")


@pytest.mark.parametrize("change,argument", [
    (lambda i: i["seq_lens"].__setitem__(0, -1), "seq_lens"),
    (lambda i: i["seq_lens"].__setitem__(0, 601), "seq_lens"),
    (lambda i: i["block_tables"].__setitem__((1, 3), 10_000), "block_tables"),
    (lambda i: i.__setitem__("block_tables", i["block_tables"][:, :2]), "block_tables"),
])
def test_check_table_entries(change, argument):
    inputs = _valid_inputs()
    buffers = golden.nan_buffers(inputs, "v1", "cpu")
    contract.check_table_entries(contract.check_call(buffers["out"], *golden.op_arguments(inputs)))
    change(inputs)
    call = contract.check_call(buffers["out"], *golden.op_arguments(inputs))
    with pytest.raises(ValueError, match=f"^{argument}: "):
        contract.check_table_entries(call)
