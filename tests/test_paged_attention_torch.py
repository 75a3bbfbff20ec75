"""The PyTorch backend against vLLM's golden outputs and the float64 reference.

Golden cases: every output of v1 and v2 within 2x vLLM's own error + 1e-5 (tests.golden's rule).
Random cases (vLLM's test distribution, NaN-poisoned unused slots) over a dtype / cache-format
tolerance table, then the edges: seq_len 0, strides, scale as float or tensor, block sparsity,
tiling (fixed cuts and seeded random plans), and bad tables.
"""

import math
import random

import pytest
import torch

from kernels import contract, get_backend, paged_attention_torch
from tests import golden
from tests.reference import reference_attention

BACKEND = get_backend("torch")


# --- the reference itself, checked against the numbers vLLM's run recorded ---------------------

@pytest.mark.skipif(golden.load_golden() is None, reason="golden data not found (BIV100_GOLDEN_DIR)")
def test_reference_reproduces_vllms_measured_errors():
    for case in golden.golden_cases():
        ref, measured, v2 = golden.reference_for(case), case["measured"], case["outputs_v2"]
        written = ref["written"]
        assert torch.equal(torch.isnan(v2["max_logits"]), ~written)
        pairs = [((case["outputs_v1"]["out"].double() - ref["out"]).abs().max(), measured["max_abs_v1_vs_ref"]),
                 ((v2["out"].double() - ref["out"]).abs().max(), measured["max_abs_v2_vs_ref"]),
                 ((v2["max_logits"].double() - ref["max_logits"])[written].abs().max(),
                  measured["max_abs_max_logits_vs_ref"]),
                 (((v2["exp_sums"].double() - ref["exp_sums"]) / ref["exp_sums"])[written].abs().max(),
                  measured["max_rel_exp_sums_vs_ref"]),
                 ((v2["tmp_out"].double() - ref["tmp_out"])[written].abs().max(), measured["max_abs_tmp_out_vs_ref"])]
        for ours, theirs in pairs:
            assert float(ours) == pytest.approx(theirs, rel=1e-4, abs=1e-12), case["params"]["name"]


# --- golden cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", golden.VERSIONS)
@pytest.mark.parametrize("name", golden.golden_case_names())
def test_golden(name, version, device):
    case = golden.golden_case(name)
    outputs = golden.run_op(BACKEND, case["inputs"], version, device)
    errors = golden.check_against_reference(outputs, golden.reference_for(case), golden.golden_tolerance(case, version))
    assert errors["out"] > 0 or case["params"]["dtype"] == "float32"  # a real comparison ran


# --- random cases: (query dtype, cache format) x shapes -------------------------------------------

DTYPE_FORMATS = [
    (torch.float32, "auto"),
    (torch.float16, "auto"),
    (torch.bfloat16, "auto"),
    (torch.float16, "fp8_e4m3"),
    (torch.bfloat16, "fp8_e5m2"),
]
# head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi
SHAPES = [
    (32, 8, 4, 4, [1, 9, 40], False),
    (64, 16, 8, 2, [0, 17, 530], True),
    (80, 32, 6, 1, [33, 1025], False),
    (96, 8, 4, 2, [511, 512, 513], True),
    (112, 16, 2, 1, [100], False),
    (120, 32, 3, 3, [7, 64], True),
    (128, 16, 8, 8, [1, 600], False),
    (192, 8, 4, 1, [300, 2], True),
    (256, 32, 2, 2, [1100, 31], False),
]


def _shape_id(shape):
    head, block, heads, kv_heads, lens, alibi = shape
    return f"d{head}-b{block}-h{heads}x{kv_heads}-L{max(lens)}" + ("-alibi" if alibi else "")


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype,kv_cache_dtype", DTYPE_FORMATS, ids=lambda v: str(v).replace("torch.", ""))
def test_random_cases(dtype, kv_cache_dtype, shape, device):
    head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi = shape
    if kv_cache_dtype != "auto" and head_size % 16:
        pytest.skip("fp8 caches pack 16 dims per slot: head_size must be a multiple of 16")
    inputs = golden.random_case(dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi=alibi,
                                kv_cache_dtype=kv_cache_dtype, poison=True, seed=head_size)
    ref = golden.reference_for(inputs)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device)
        golden.check_against_reference(outputs, ref, golden.random_tolerance(inputs))


# --- edges ---------------------------------------------------------------------------------------

def test_seq_len_zero_gives_zeros_and_writes_no_partition(device):
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [0, 0, 700], poison=True)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device)
        assert torch.equal(outputs["out"][:2].cpu(), torch.zeros(2, 4, 64, dtype=torch.float16))
        if version == "v2":
            assert torch.isnan(outputs["max_logits"][:2]).all() and torch.isnan(outputs["tmp_out"][:2]).all()
            assert not torch.isnan(outputs["max_logits"][2]).any()


def test_all_sequences_empty(device):
    inputs = golden.random_case(torch.bfloat16, 128, 16, 2, 1, [0, 0])
    assert inputs["max_seq_len"] == 0
    for version in golden.VERSIONS:
        assert torch.equal(golden.run_op(BACKEND, inputs, version, device)["out"].cpu(),
                           torch.zeros(2, 2, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_nan_in_unused_slots_changes_nothing(kv_cache_dtype, device):
    golden.check_nan_in_unused_slots_changes_nothing(BACKEND, device, kv_cache_dtype)


def test_strided_tensors_give_the_same_result(device):
    golden.check_strided_tensors_give_the_same_result(BACKEND, device)


def test_scale_as_float_or_tensor(device):
    golden.check_scale_as_float_or_tensor(BACKEND, device, torch.bfloat16, "fp8")


BLOCKSPARSE = [
    # local_blocks, vert_stride, block_size, head_sliding_step, tp_rank
    (2, 4, 64, 1, 0),
    (1, 3, 32, -1, 1),
    (4, 16, 64, 0, 0),   # vert_stride * 64 > 512: some partitions are skipped entirely
    (0, 2, 16, 2, 0),
]


@pytest.mark.parametrize("sparse", BLOCKSPARSE, ids=str)
def test_blocksparse_matches_reference(sparse, device):
    local_blocks, vert_stride, bs_block_size, sliding_step, tp_rank = sparse
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [5, 700, 2100], poison=True, seed=vert_stride)
    pattern = dict(local_blocks=local_blocks, vert_stride=vert_stride, block_size=bs_block_size,
                   head_sliding_step=sliding_step, tp_rank=tp_rank)
    ref = reference_attention(**inputs, blocksparse=pattern)
    dense = reference_attention(**inputs)
    assert not torch.allclose(ref["out"], dense["out"], atol=1e-3)  # the pattern really changes the result
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device, **golden.blocksparse_keywords(pattern))
        golden.check_against_reference(outputs, ref, golden.random_tolerance(inputs))


_TILED_CASE = dict(dtype=torch.float32, head_size=64, block_size=16, num_heads=4, num_kv_heads=2,
                   seq_lens=[1, 513, 1600, 40, 0], alibi=True, poison=True)


def _tiled_call(inputs, version, device):
    on_device = golden.to_device(inputs, device)
    buffers = golden.nan_buffers(on_device, version, device)
    partition_buffers = {name: buffers[name] for name in ("exp_sums", "max_logits", "tmp_out") if name in buffers}
    return contract.check_call(buffers["out"], *golden.op_arguments(on_device), **partition_buffers)


def _plan_of(call):
    return paged_attention_torch._plan(call, paged_attention_torch._bmm_float32_out(call.query.device,
                                                                                   call.query.dtype))


@pytest.mark.parametrize("tile_sequences,result_sequences,reduces", [
    (0, None, 1),  # each sequence in tiles of one partition, all reduced together
    (0, 1, 5),     # each sequence in tiles of one partition, reduced alone
    (0, 2, 3),     # each sequence in tiles of one partition, reduced two at a time
    (2, None, 1),  # chunks of 2 sequences, all reduced together
    (2, 1, 3),     # chunks of 2 sequences, each reduced alone
    (2, 4, 2),     # chunks of 2 sequences, reduced two chunks at a time
], ids=["one-partition-tiles", "one-partition-tiles-reduce-each", "one-partition-tiles-reduce-pairs",
        "two-sequence-chunks", "reduce-per-chunk", "reduce-two-chunks"])
@pytest.mark.parametrize("version", golden.VERSIONS)
def test_small_tiles_give_the_same_result(tile_sequences, result_sequences, reduces, version, monkeypatch, device):
    """Tiles and reduce groups cut smaller than the default (one tile, one reduce) change no value. v1 takes
    one softmax over a sequence's partitions (as vLLM's v1 kernel does) where a tile holds whole sequences;
    in tiles of single partitions it reduces them as v2 does, so those are checked against v2's ``out``."""
    inputs = golden.random_case(**_TILED_CASE)
    default_plan = _plan_of(_tiled_call(inputs, version, device))
    assert (default_plan.chunk, default_plan.partitions, default_plan.joint) == (5, 4, version == "v1")
    expected = golden.run_op(BACKEND, inputs, "v2" if tile_sequences == 0 else version, device)
    monkeypatch.setattr(paged_attention_torch, "MAX_TILE_BYTES",
                        max(1, tile_sequences * default_plan.tile_bytes // 5 + 1))
    plan = _plan_of(_tiled_call(inputs, version, device))
    assert (plan.chunk, plan.tile_parts, plan.joint) == ((1, 1, False) if tile_sequences == 0
                                                         else (2, 4, version == "v1"))
    if result_sequences is not None:
        monkeypatch.setattr(paged_attention_torch, "MAX_RESULT_BYTES",
                            result_sequences * 4 * plan.partitions * (64 + 2) * 4)
    reduce_calls = []
    reduce = paged_attention_torch._reduce
    monkeypatch.setattr(paged_attention_torch, "_reduce", lambda *args: reduce_calls.append(1) or reduce(*args))
    actual = golden.run_op(BACKEND, inputs, version, device)
    assert len(reduce_calls) == reduces
    for name, tensor in actual.items():
        assert torch.allclose(tensor.nan_to_num(), expected[name].nan_to_num(), rtol=1e-6, atol=1e-6), name
        assert torch.equal(tensor.isnan(), expected[name].isnan()), name


def test_v1_takes_one_softmax_per_sequence_like_vllms_v1():
    """vLLM's v1 kernel takes one softmax over the whole sequence and rounds its p to the query dtype; the
    backend's v1 does too where a tile holds whole sequences (its partitions' outputs then add up, with no
    rescaling reduce). In bfloat16 that rounding tells them apart: v1 matches a one-softmax float64 model,
    while v2's reduce over 4 partitions, each rounding its own p, lands 1.5e-5 away (measured on this case)."""
    inputs = golden.random_case(torch.bfloat16, 64, 16, 4, 2, [1600])
    v1 = golden.run_op(BACKEND, inputs, "v1", "cpu")["out"].double()
    v2 = golden.run_op(BACKEND, inputs, "v2", "cpu")["out"].double()
    blocks = inputs["block_tables"][0, :100].long()
    keys = inputs["key_cache"].double()[blocks].permute(1, 0, 3, 2, 4).reshape(2, 1600, 64)
    values = inputs["value_cache"].double()[blocks].permute(1, 0, 3, 2).reshape(2, 1600, 64)
    logits = inputs["scale"] * inputs["query"].double()[0].view(2, 2, 64) @ keys.transpose(1, 2)
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    probs = (weights / (weights.sum(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double()
    one_softmax = (probs @ values).view(1, 4, 64).to(torch.bfloat16).double()
    assert (v1 - one_softmax).abs().max() < 1e-7
    assert (v2 - one_softmax).abs().max() > 5e-6


# --- random plans: any cut into tiles and reduce groups, on random shapes and options -------------

RANDOM_PLAN_SEEDS = range(24)


def _random_plan_case(seed):
    """One seeded draw: dtype, cache format, shape, lengths (0, 1, partition edges, several partitions),
    ALiBi, scale (zero and negative included), block sparsity, and the tile and reduce-group budgets
    (one byte, a few MB or the defaults). Returns (inputs, blocksparse, op keywords, tile bytes, result bytes)."""
    draw = random.Random(seed)
    dtype = draw.choice([torch.float32, torch.float16, torch.bfloat16])
    kv_cache_dtype = draw.choice(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])
    head_size = draw.choice([32, 64, 80, 96, 128, 192] if kv_cache_dtype == "auto" else [32, 64, 96, 128])
    block_size, num_kv_heads = draw.choice([8, 16, 32]), draw.choice([1, 2, 3])
    seq_lens = [draw.choice([0, 1, 511, 512, 513, 1024, draw.randint(1, 600), draw.randint(500, 1700)])
                for _ in range(draw.randint(1, 5))]
    inputs = golden.random_case(dtype, head_size, block_size, num_kv_heads * draw.choice([1, 2, 4, 8]),
                                num_kv_heads, seq_lens, seed=seed, alibi=draw.random() < 0.3,
                                kv_cache_dtype=kv_cache_dtype, poison=True, v_scale=draw.choice([1.0, 2.0]))
    if draw.random() < 0.2:
        inputs["scale"] = draw.choice([0.0, -0.1])
    sparse, keywords = None, {}
    if draw.random() < 0.2:
        sparse = dict(local_blocks=draw.randint(0, 3), vert_stride=draw.choice([2, 3, 4]),
                      block_size=max(block_size, draw.choice([16, 64])), head_sliding_step=draw.choice([-1, 0, 2]),
                      tp_rank=draw.randint(0, 1))
        keywords = golden.blocksparse_keywords(sparse)
    tile_bytes = draw.choice([paged_attention_torch.MAX_TILE_BYTES, 1, draw.randint(1, 4 << 20)])
    result_bytes = draw.choice([paged_attention_torch.MAX_RESULT_BYTES, 1, draw.randint(1, 1 << 20)])
    return inputs, sparse, keywords, tile_bytes, result_bytes


@pytest.mark.parametrize("seed", RANDOM_PLAN_SEEDS)
def test_random_plans_match_reference(seed, monkeypatch, device):
    inputs, sparse, keywords, tile_bytes, result_bytes = _random_plan_case(seed)
    monkeypatch.setattr(paged_attention_torch, "MAX_TILE_BYTES", tile_bytes)
    monkeypatch.setattr(paged_attention_torch, "MAX_RESULT_BYTES", result_bytes)
    ref = reference_attention(**inputs, blocksparse=sparse)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device, **keywords)
        golden.check_against_reference(outputs, ref, golden.random_tolerance(inputs))


def test_random_plans_cover_every_kind_of_cut(monkeypatch):
    """The seeds of ``test_random_plans_match_reference`` reach every way ``_plan`` cuts a call: one tile,
    tiles of whole sequences (v1's one softmax across them), sequences split over tiles, v2's per-partition
    softmax, and several reduce groups."""
    kinds = set()
    for seed in RANDOM_PLAN_SEEDS:
        inputs, _, _, tile_bytes, result_bytes = _random_plan_case(seed)
        if inputs["max_seq_len"] == 0:
            continue
        monkeypatch.setattr(paged_attention_torch, "MAX_TILE_BYTES", tile_bytes)
        monkeypatch.setattr(paged_attention_torch, "MAX_RESULT_BYTES", result_bytes)
        for version in golden.VERSIONS:
            call = _tiled_call(inputs, version, "cpu")
            plan = _plan_of(call)
            kinds.add("one tile" if plan.chunk >= call.num_seqs and plan.tile_parts == plan.partitions
                      else "split sequences" if plan.tile_parts < plan.partitions else "chunks")
            kinds.add(("joint" if plan.joint else "per partition") + (" chunks" if plan.chunk < call.num_seqs else ""))
            if paged_attention_torch._reduce_group(call, plan) < call.num_seqs:
                kinds.add("several reduce groups")
    assert kinds >= {"one tile", "chunks", "split sequences", "joint", "joint chunks", "per partition",
                     "per partition chunks", "several reduce groups"}, kinds


# --- bad tables: NaN for the sequence concerned, never an out-of-bounds access; or a ValueError ---

_BASE = dict(dtype=torch.float16, head_size=64, block_size=16, num_heads=4, num_kv_heads=2,
             seq_lens=[100, 40, 600], poison=True)
_BREAKERS = golden.BAD_TABLE_BREAKERS


@pytest.mark.parametrize("breaker", _BREAKERS, ids=lambda f: f.__name__)
def test_bad_table_gives_nan_for_that_sequence_only(breaker, device):
    inputs = golden.random_case(**_BASE)
    ref = golden.reference_for(inputs)
    breaker(inputs)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device)
        assert torch.isnan(outputs["out"][1]).all()
        good = [0, 2]
        kept = {name: tensor[good] for name, tensor in outputs.items()}
        good_ref = {name: tensor[good] for name, tensor in ref.items()}
        golden.check_against_reference(kept, good_ref, golden.random_tolerance(inputs))
        if version == "v2":
            written = min(-(-int(inputs["seq_lens"][1]) // 512), outputs["max_logits"].shape[2])
            assert torch.isnan(outputs["max_logits"][1]).all() and torch.isnan(outputs["tmp_out"][1]).all()
            assert written >= 1


@pytest.mark.parametrize("breaker", _BREAKERS, ids=lambda f: f.__name__)
def test_validate_tables_rejects_bad_tables_before_writing(breaker, device):
    inputs = golden.random_case(**_BASE)
    breaker(inputs)
    inputs = golden.to_device(inputs, device)
    checked = get_backend("torch", validate_tables=True)
    for version in golden.VERSIONS:
        buffers = golden.nan_buffers(inputs, version, device)
        with pytest.raises(ValueError, match="seq_lens|block_tables"):
            golden.call_op(checked, version, buffers, inputs)
        assert all(torch.isnan(tensor).all() for tensor in buffers.values())


def test_validate_tables_accepts_good_tables(device):
    inputs = golden.random_case(**_BASE)
    checked = get_backend("torch", validate_tables=True)
    outputs = golden.run_op(checked, inputs, "v2", device)
    golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))


def test_no_sequences(device):
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [])
    inputs["max_seq_len"] = 0
    assert golden.run_op(BACKEND, inputs, "v2", device)["out"].shape == (0, 4, 64)


# --- gathers in words: bit-exact or not used ---

def test_gathers_move_cache_bits_unchanged(device):
    """Whatever word dtype the device gets, K and V gathered through it keep every bit (NaN payloads too)."""
    bits = torch.randint(-32768, 32768, (6, 2, 8, 16, 8), dtype=torch.int16, device=device)
    bits[0, 0, 0, 0] = 0x7C01  # a signalling NaN in fp16
    key_cache = bits.view(torch.float16)
    value_cache = bits.view(6, 2, 64, 16).view(torch.float16)
    blocks = torch.tensor([4, 0, 5, 0], device=device)
    torch_backend = paged_attention_torch
    for cache, order, word_bytes in ((key_cache, torch_backend._KEY_ORDER, torch_backend._KEY_WORD_BYTES),
                                     (value_cache, torch_backend._VALUE_ORDER, torch_backend._VALUE_WORD_BYTES)):
        source = paged_attention_torch._Source(cache, order, word_bytes)
        gathered = paged_attention_torch._gather(source, blocks, torch.float16, None)
        expected = cache.permute(order).index_select(order.index(0), blocks)
        assert torch.equal(gathered.view(torch.int16), expected.contiguous().view(torch.int16))


def test_word_dtype_falls_back_where_16_byte_copies_change_bits(monkeypatch):
    real = torch.index_select

    def quieting(input, dim, index, **kwargs):  # a device whose complex128 copies quiet signalling NaNs
        out = real(input, dim, index, **kwargs)
        if out.dtype == torch.complex128:
            words = out.view(torch.int64)
            signalling = ((words & 0x7FF8000000000000) == 0x7FF0000000000000) & ((words & 0x000FFFFFFFFFFFFF) != 0)
            words[signalling] |= 0x0008000000000000
        return out

    monkeypatch.setattr(paged_attention_torch, "_WORD_DTYPES", {})
    assert paged_attention_torch._word_dtype(torch.device("cpu")) == torch.complex128  # CPU copies keep bits
    monkeypatch.setattr(paged_attention_torch, "_WORD_DTYPES", {})
    monkeypatch.setattr(torch, "index_select", quieting)
    assert paged_attention_torch._word_dtype(torch.device("cpu")) == torch.int64


@pytest.mark.parametrize("kv_cache_dtype,mixed", [("auto", True), ("auto", False), ("fp8_e4m3", False)])
@pytest.mark.parametrize("version", golden.VERSIONS)
def test_planned_tiles_respect_the_byte_budget(kv_cache_dtype, mixed, version):
    def plan(max_seq_len):
        call = contract.DecodeCall(query=torch.empty(64, 32, 128, dtype=torch.float16), kv_cache_dtype=kv_cache_dtype,
                                   num_kv_heads=8, num_heads=32, head_size=128, block_size=16, max_seq_len=max_seq_len,
                                   max_num_partitions=-(-max_seq_len // 512), num_seqs=64, alibi_slopes=None,
                                   blocksparse=None, scale=0.125, exp_sums=object() if version == "v2" else None)
        planned = paged_attention_torch._plan(call, mixed)
        tokens = planned.chunk * planned.tile_parts * planned.columns * 16
        assert tokens * paged_attention_torch._bytes_per_token(call, mixed) < planned.tile_bytes
        assert planned.tile_bytes <= paged_attention_torch.MAX_TILE_BYTES
        return planned

    planned = plan(8192)  # whole sequences per tile: v1 takes one softmax over each one's 16 partitions
    assert (planned.columns, planned.partitions, planned.tile_parts) == (32, 16, 16)
    assert planned.chunk >= (2 if mixed else 1) and planned.joint == (version == "v1")
    planned = plan(1 << 20)  # one sequence is over budget: tiles of partitions, reduced (v1 too)
    assert (planned.columns, planned.chunk, planned.joint) == (32, 1, False) and 1 <= planned.tile_parts < 2048
    planned = plan(40)  # one partition: only the blocks max_seq_len needs
    assert (planned.columns, planned.partitions) == (3, 1)


def test_nan_tolerance_of_unwritten_partitions_is_checked():
    """The checker itself: a written partition past a sequence's end is caught."""
    inputs = golden.random_case(torch.float32, 64, 16, 2, 2, [10, 600])
    outputs = golden.run_op(BACKEND, inputs, "v2", "cpu")
    outputs["exp_sums"][0, 0, 1] = 1.0
    with pytest.raises(AssertionError, match="past its sequence"):
        golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))
    outputs = golden.run_op(BACKEND, inputs, "v1", "cpu")
    outputs["out"][1, 0, 0] += 0.01
    with pytest.raises(AssertionError, match="out: max error"):
        golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))
    assert math.isfinite(float(outputs["out"].abs().max()))


@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float16, "auto"), (torch.bfloat16, "fp8_e4m3")])
def test_mixed_precision_matmul_path(dtype, kv_cache_dtype, monkeypatch):
    """Where bmm can write float32 from half inputs (CUDA), K, V and p stay in the query dtype.

    Emulated on the CPU: the matmul is replaced by an exact float32 one that records its input dtypes.
    """
    seen = set()

    def bmm_float32_out(a, b, mixed):
        assert mixed
        seen.update((a.dtype, b.dtype))
        return torch.bmm(a.float(), b.float())

    monkeypatch.setattr(paged_attention_torch, "_bmm_float32_out", lambda device, dtype: True)
    monkeypatch.setattr(paged_attention_torch, "_bmm32", bmm_float32_out)
    inputs = golden.random_case(dtype, 128, 16, 8, 2, [3, 700], alibi=True, kv_cache_dtype=kv_cache_dtype,
                                poison=True)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, "cpu")
        golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))
    assert seen == {dtype}


_PEAK_SCRIPT = r"""
import resource, sys, torch
from kernels import contract, paged_attention_torch
from kernels.backend import get_backend
torch.set_num_threads(1)
paged_attention_torch.MAX_TILE_BYTES = 2 << 20
seqs, heads, kv_heads, head_size, block, length = 4, 8, 2, 128, 16, 4096
blocks = seqs * length // block
key_cache = torch.empty(blocks, kv_heads, head_size // 8, block, 8, dtype=torch.float16).uniform_(-1, 1)
value_cache = torch.empty(blocks, kv_heads, head_size, block, dtype=torch.float16).uniform_(-1, 1)
tables = torch.randperm(blocks).to(torch.int32).view(seqs, -1)
query = torch.rand(seqs, heads, head_size, dtype=torch.float16)
out = torch.empty_like(query)
lens = torch.full((seqs,), length, dtype=torch.int32)
args = (query, key_cache, value_cache, kv_heads, 0.088, tables, lens, block, length, None, "auto", 1.0, 1.0)
backend = get_backend("torch")
# Warm up on one 1024-token sequence in a cache of its own: the same tiles (one partition each), a sixteenth
# of the K+V (a gather that copied its whole cache would copy only that much here).
small = blocks // 16
backend.paged_attention_v1(out[:1], query[:1], key_cache[:small], value_cache[:small], kv_heads, 0.088,
                           torch.arange(small, dtype=torch.int32).view(1, small),
                           torch.full((1,), 1024, dtype=torch.int32), block, 1024, None, "auto", 1.0, 1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
backend.paged_attention_v1(out, *args)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
bound = paged_attention_torch.peak_extra_bytes(contract.check_call(out, *args))
print(after - before, bound, key_cache.nbytes + value_cache.nbytes)
"""


def test_peak_extra_memory_does_not_grow_with_the_input():
    """On the CPU, as growth of the process's peak RSS: a call over 16 MiB of K+V with a 2 MiB tile
    budget needs no more memory than a warm-up call over a 1 MiB cache (without tiles, gathering K and V
    alone would take 16 MiB; a gather through the CPU's index_select on a strided source, 8 MiB per
    cache). The GPU test below checks ``peak_extra_bytes`` exactly."""
    import subprocess
    import sys
    from tests.conftest import REPO_ROOT
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    growth, bound, cache_bytes = (int(v) for v in result.stdout.split())
    assert bound < cache_bytes / 4  # a 2 MiB tile and the results of all 4 sequences, reduced together
    assert growth <= 1 << 20, (growth, bound)  # allocator slack only


def _profiled_peak_bytes(function):
    """Peak of the running total of CPU tensor memory allocated while ``function`` runs, at op granularity
    (torch.profiler's memory events: each op's net allocation, and frees outside ops)."""
    from torch.profiler import profile
    with profile(profile_memory=True) as prof:
        function()
    level = peak = 0
    for event in sorted(prof.events(), key=lambda event: event.time_range.start):
        level += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("dtype,kv_cache_dtype,seq_lens,alibi,tile_bytes", [
    (torch.float16, "auto", [700, 3, 1600], False, None),                 # one tile
    (torch.bfloat16, "fp8_e4m3", [700, 3, 1600], True, None),             # fp8 lookups, explicit logits
    (torch.float32, "auto", [1, 513, 1600, 40, 0], True, 1),              # one-partition tiles
    (torch.float16, "auto", [2048] * 4, False, 2 << 20),                  # chunks of sequences
], ids=["fp16", "fp8-alibi", "partition-tiles", "sequence-chunks"])
@pytest.mark.parametrize("version", golden.VERSIONS)
def test_peak_extra_bytes_bounds_the_allocations(dtype, kv_cache_dtype, seq_lens, alibi, tile_bytes, version,
                                                 monkeypatch):
    if tile_bytes is not None:
        monkeypatch.setattr(paged_attention_torch, "MAX_TILE_BYTES", tile_bytes)
    inputs = golden.random_case(dtype, 128, 16, 8, 2, seq_lens, alibi=alibi, kv_cache_dtype=kv_cache_dtype,
                                poison=True)
    buffers = golden.nan_buffers(inputs, version, "cpu")
    partition_buffers = {name: buffers[name] for name in ("exp_sums", "max_logits", "tmp_out") if name in buffers}
    call = contract.check_call(buffers["out"], *golden.op_arguments(inputs), **partition_buffers)
    bound = paged_attention_torch.peak_extra_bytes(call)
    peak = _profiled_peak_bytes(lambda: paged_attention_torch.forward(call))
    assert bound / 2 < peak <= bound, (peak, bound)  # a real bound, and not a loose one
    golden.check_against_reference(buffers, golden.reference_for(inputs), golden.random_tolerance(inputs))


@pytest.mark.gpu
def test_peak_extra_memory_is_bounded_on_gpu(monkeypatch):
    monkeypatch.setattr(paged_attention_torch, "MAX_TILE_BYTES", 64 << 20)
    inputs = golden.to_device(golden.random_case(torch.float16, 128, 16, 32, 8, [8192] * 16, seed=3), "cuda")
    buffers = golden.nan_buffers(inputs, "v2", "cuda")
    call = contract.check_call(buffers["out"], *golden.op_arguments(inputs), exp_sums=buffers["exp_sums"],
                               max_logits=buffers["max_logits"], tmp_out=buffers["tmp_out"])
    # cuBLAS takes its workspace (32 MiB on Hopper) from the caching allocator at a process's first matmul
    # and keeps it: not per-call memory (vLLM's own matmuls have made it long before decoding).
    torch.bmm(torch.ones(1, 16, 16, device="cuda", dtype=torch.float16),
              torch.ones(1, 16, 16, device="cuda", dtype=torch.float16))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    paged_attention_torch.forward(call)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - baseline
    assert growth <= paged_attention_torch.peak_extra_bytes(call), growth
    golden.check_against_reference(buffers, golden.reference_for(inputs), golden.random_tolerance(inputs))
