"""The Triton backend against vLLM's golden outputs and the float64 reference.

On CPU it runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on CUDA on the device.
Golden cases: every output of v1 and v2 within 2x vLLM's own error + 1e-5. Random cases: a
(dtype, cache format, shape) table at vLLM's test tolerances; then the paths the planner picks
(split-KV v1, head chunks, gathered steps), the edges, bad tables, and the config choice.
"""

import math

import pytest
import torch

from kernels import configs, get_backend, paged_attention_triton
from kernels.limits import DeviceLimits
from tests import golden
from tests.reference import fp8_bits_to_float64, reference_attention

BACKEND = get_backend("triton")
# Many SMs: v1 splits every sequence (split-KV and its reduce); 16 SMs x 48 KB: a BI-V100's figures.
SPLITTING_LIMITS = DeviceLimits(48 * 1024, 1024, 32, (7, 0))
SPLITTING = get_backend("triton", limits=SPLITTING_LIMITS)
BI_V100 = DeviceLimits(48 * 1024, 16, 64, (7, 0))
# An H200's figures: grouped heads take the pipelined tl.dot path, whose whole steps load unmasked.
H200 = DeviceLimits(232448, 132, 32, (9, 0))
# Under Triton 2.x (configs.triton_3) the H200's figures pick the prefetch path and 16-row programs.
TRITON_3 = pytest.mark.skipif(not configs.triton_3(),
                              reason="Triton 2.x keeps to the prefetch path and 16 query rows per program")


# --- golden cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", golden.VERSIONS)
@pytest.mark.parametrize("name", golden.golden_case_names())
def test_golden(name, version, device):
    case = golden.golden_case(name)
    outputs = golden.run_op(BACKEND, case["inputs"], version, device)
    errors = golden.check_against_reference(outputs, golden.reference_for(case), golden.golden_tolerance(case, version))
    assert errors["out"] > 0  # a real comparison ran


def test_golden_cases_are_there():
    assert len(golden.golden_case_names()) == 20, "golden data not found (BIV100_GOLDEN_DIR)"


# --- random cases: a (query dtype, cache format, shape) table ------------------------------------

# dtype, kv_cache_dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi
RANDOM_CASES = [
    (torch.float32, "auto", 32, 8, 4, 4, [1, 9, 40], False),
    (torch.float16, "auto", 64, 16, 8, 2, [0, 17, 530], True),
    (torch.bfloat16, "auto", 80, 32, 6, 1, [33, 1025], False),
    (torch.float16, "fp8_e4m3", 96, 8, 4, 2, [511, 512, 513], True),
    (torch.bfloat16, "fp8_e5m2", 112, 16, 2, 1, [100], False),
    (torch.float32, "auto", 120, 32, 3, 3, [7, 64], True),
    (torch.bfloat16, "fp8", 128, 16, 4, 4, [1, 600], False),
    (torch.float16, "auto", 192, 8, 4, 1, [300, 2], True),
    (torch.float32, "fp8_e4m3", 256, 32, 2, 2, [700, 31], False),
    (torch.float16, "auto", 128, 16, 40, 1, [70, 3], False),  # 40 query heads per kv head: 3 head chunks
]


def _case_id(case):
    dtype, fmt, head, block, heads, kv_heads, lens, alibi = case
    return f"{str(dtype)[6:]}-{fmt}-d{head}-b{block}-h{heads}x{kv_heads}-L{max(lens)}" + ("-alibi" if alibi else "")


@pytest.mark.parametrize("case", RANDOM_CASES, ids=_case_id)
def test_random_cases(case, device):
    dtype, kv_cache_dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi = case
    inputs = golden.random_case(dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi=alibi,
                                kv_cache_dtype=kv_cache_dtype, poison=True, seed=head_size)
    ref = golden.reference_for(inputs)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device)
        golden.check_against_reference(outputs, ref, golden.random_tolerance(inputs))


# --- the planner's paths -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,block_size", [(torch.float16, 16), (torch.bfloat16, 8), (torch.float32, 32)])
def test_split_kv_v1_matches_reference(dtype, block_size, device):
    inputs = golden.random_case(dtype, 64, block_size, 4, 1, [1, 300, 1200, 0], alibi=True, poison=True)
    outputs = golden.run_op(SPLITTING, inputs, "v1", device)
    golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))


def test_v1_reduces_its_splits_in_the_attention_launch(monkeypatch, device):
    # v1's splits are combined by the program that finishes last: one launch, no reduce kernel; the arrival
    # counters are back at 0 after each call, so a repeated call gives the first call's output bit for bit.
    # Sequence 1 has one bad block (in one of its splits): only that sequence becomes NaN.
    reduces, scratch = [], []
    monkeypatch.setattr(paged_attention_triton, "_reduce", lambda *args: reduces.append(args))
    scratch_for = paged_attention_triton._Plan.scratch_for
    monkeypatch.setattr(paged_attention_triton._Plan, "scratch_for",
                        lambda plan, *args: scratch.append(scratch_for(plan, *args)) or scratch[-1])
    # 9 splits of 80 tokens; the group's 4 heads in 2 tiles of 2 rows, the splits in tiles of 4 + 4 + 1.
    monkeypatch.setattr(configs, "FUSED_REDUCE_MAX_ROUNDS", 3)
    monkeypatch.setattr(configs, "combine_tile", lambda *args: (2, 4))
    inputs = golden.random_case(torch.float16, 64, 16, 8, 2, [700, 600, 0, 130], poison=True)
    ref = golden.reference_for(inputs)
    golden.entry_too_large(inputs)
    backend = get_backend("triton", limits=SPLITTING_LIMITS)
    first = golden.run_op(backend, inputs, "v1", device)
    again = golden.run_op(backend, inputs, "v1", device)
    assert not reduces and scratch and scratch[0][1].shape[2] == 9  # split, and reduced in the same launch
    counters = scratch[-1][3]
    assert counters.shape == (4, 2) and not counters.any()
    assert torch.equal(first["out"].nan_to_num(), again["out"].nan_to_num())
    assert torch.isnan(first["out"][1]).all() and not torch.isnan(first["out"][[0, 2, 3]]).any()
    good = [0, 2, 3]
    golden.check_against_reference({"out": first["out"][good]}, {"out": ref["out"][good]},
                                   golden.random_tolerance(inputs))


@pytest.fixture
def reduce_launches(monkeypatch):
    """One entry per ``_reduce_kernel`` launch, which still runs."""
    reduce, launches = paged_attention_triton._reduce, []
    monkeypatch.setattr(paged_attention_triton, "_reduce", lambda *args: launches.append(1) or reduce(*args))
    return launches


def test_v1_fuses_at_most_one_tile_of_eight_splits(reduce_launches, device):
    # MHA: 300 tokens in 4 splits are combined in the attention launch (a one-row tile of 8 splits); 1200 in 15
    # go to _reduce_kernel. Both match the reference.
    config = configs.choose_config(SPLITTING_LIMITS, 64, 16, torch.float16, "auto", 1)
    assert configs.combine_tile(config, 1, 64, SPLITTING_LIMITS.warp_size) == (1, 8)
    for seq_lens, expected_reduces in (([300, 40], []), ([1200], [1])):
        reduce_launches.clear()
        inputs = golden.random_case(torch.float16, 64, 16, 4, 4, seq_lens, poison=True)
        outputs = golden.run_op(SPLITTING, inputs, "v1", device)
        assert reduce_launches == expected_reduces, seq_lens
        golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))


def test_v1_short_rows_take_the_fused_tiles_split_count(reduce_launches, device):
    # 16 SMs: MHA's 4 programs x 1200 tokens would take 15 splits (a reduce launch); 8 still give every SM a
    # program, so the row takes 8 and reduces them in the attention launch, matching the reference.
    limits = DeviceLimits(48 * 1024, 16, 32, (7, 0))
    inputs = golden.random_case(torch.float16, 64, 16, 4, 4, [1200], poison=True)
    outputs = golden.run_op(get_backend("triton", limits=limits), inputs, "v1", device)
    assert reduce_launches == []
    golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))
    config = configs.choose_config(limits, 64, 16, torch.float16, "auto", 1)
    fused = configs.combine_tile(config, 1, 64, limits.warp_size)[1]
    assert fused == 8 and configs.choose_splits(limits, 4, 1200, config.block_n) == (15, 80)
    assert configs.choose_splits(limits, 4, 1200, config.block_n, fused)[0] == 8


@pytest.mark.parametrize("dtype,block_size,kv_cache_dtype", [(torch.float16, 16, "auto"), (torch.bfloat16, 8, "auto"),
                                                              (torch.float32, 32, "fp8_e5m2")])
def test_v2_sub_splits_match_reference(dtype, block_size, kv_cache_dtype, device):
    # Many SMs: every 512-token partition is cut into sub-splits, combined into vLLM's partition outputs.
    inputs = golden.random_case(dtype, 64, block_size, 4, 1, [1, 300, 1200, 0], alibi=True, poison=True,
                                kv_cache_dtype=kv_cache_dtype)
    outputs = golden.run_op(SPLITTING, inputs, "v2", device)
    golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))


def test_v2_sub_splits_are_planned_from_the_wave():
    many = DeviceLimits(228 * 1024, 132, 32, (9, 0))
    assert configs.choose_subsplits(many, 8, 4, 512, 16) == 8       # 1 x 2048 grouped: 32 -> 256 programs
    assert configs.choose_subsplits(many, 8, 16, 512, 16) == 4      # 1 x 8192: 128 -> 512 programs, 132 SMs x 4
    assert configs.choose_subsplits(many, 64, 4, 512, 16) == 2      # 8 x 2048: 256 -> 512 programs
    assert configs.choose_subsplits(many, 8, 64, 512, 16) == 1      # 1 x 32768: 512 programs already
    assert configs.choose_subsplits(many, 64, 16, 512, 16) == 1     # 8 x 8192: 1024 programs already
    assert configs.choose_subsplits(many, 1, 1, 512, 32) == configs.MAX_SUBSPLITS
    assert configs.choose_subsplits(BI_V100, 8, 4, 512, 16) == 2    # 32 -> 64 programs: 16 SMs x 4
    assert configs.choose_subsplits(BI_V100, 2, 2, 512, 16) == 8    # 4 programs x 2 partitions x 8 = 64: 16 SMs x 4
    assert configs.choose_subsplits(many, 1, 64, 512, 16) == 4      # 64 partitions x 4: the reduce's 256 splits


def test_partition_reduce_tile_holds_every_sub_split():
    assert configs.partition_reduce_tile(4, 8, 128) == (4, 128)     # 1 x 2048: 32 sub-splits, all dims
    assert configs.partition_reduce_tile(16, 8, 128) == (16, 32)    # 1 x 8192: 128 sub-splits, 4 dim chunks
    assert configs.partition_reduce_tile(3, 2, 80) == (4, 128)
    assert configs.partition_reduce_tile(64, 4, 256) == (64, 16)


def test_partition_reduce_in_dim_chunks(monkeypatch, device):
    # v2 from sub-splits with a 16-dim tile: the one kernel that writes the partitions and reduces them
    # splits a head's dims over programs; a broken sequence still turns its out and partitions into NaN.
    monkeypatch.setattr(configs, "REDUCE_TILE", 64)
    launched = []
    launcher = paged_attention_triton._partition_reduce
    monkeypatch.setattr(paged_attention_triton, "_partition_reduce",
                        lambda key, grid, *rest: launched.append(grid) or launcher(key, grid, *rest))
    inputs = golden.random_case(torch.float16, 64, 16, 4, 1, [1200, 1700, 40], alibi=True, poison=True)
    ref = golden.reference_for(inputs)
    golden.BAD_TABLE_BREAKERS[0](inputs)
    outputs = golden.run_op(get_backend("triton", limits=SPLITTING_LIMITS), inputs, "v2", device)
    assert launched and launched[0][2] == 4  # 64 dims in chunks of 16
    assert torch.isnan(outputs["out"][1]).all()
    for name in ("max_logits", "exp_sums", "tmp_out"):
        assert torch.isnan(outputs[name][1, :, :4]).all()
    good = [0, 2]
    golden.check_against_reference({k: v[good] for k, v in outputs.items()},
                                   {k: v[good] for k, v in ref.items()}, golden.random_tolerance(inputs))


def test_reduce_in_several_loads_and_dim_chunks(monkeypatch, device):
    # A 2-split, 16-dim tile: the reduce loops over loads and splits a head's dims over programs;
    # a broken sequence still turns its out and every split it wrote into NaN. v1's splits go to the reduce
    # kernel too (over the fused reduce's bound).
    monkeypatch.setattr(configs, "REDUCE_MAX_SPLITS", 2)
    monkeypatch.setattr(configs, "FUSED_REDUCE_MAX_ROUNDS", 0)
    monkeypatch.setattr(configs, "REDUCE_TILE", 32)
    assert configs.reduce_tile(3, 64) == (2, 16)
    inputs = golden.random_case(torch.float16, 64, 16, 4, 1, [1200, 1700, 40], alibi=True, poison=True)
    ref = golden.reference_for(inputs)
    golden.BAD_TABLE_BREAKERS[0](inputs)
    for backend in (get_backend("triton"), get_backend("triton", limits=SPLITTING_LIMITS)):
        for version in golden.VERSIONS:
            outputs = golden.run_op(backend, inputs, version, device)
            assert torch.isnan(outputs["out"][1]).all()
            if version == "v2":
                assert torch.isnan(outputs["max_logits"][1, :, :4]).all()
                assert torch.isnan(outputs["exp_sums"][1, :, :4]).all()
                assert torch.isnan(outputs["tmp_out"][1, :, :4]).all()
            good = [0, 2]
            golden.check_against_reference({k: v[good] for k, v in outputs.items()},
                                           {k: v[good] for k, v in ref.items()}, golden.random_tolerance(inputs))


def test_reduce_tile_covers_the_splits_in_one_load():
    assert configs.reduce_tile(1, 128) == (1, 128)
    assert configs.reduce_tile(64, 128) == (64, 64)
    assert configs.reduce_tile(200, 80) == (256, 16)
    assert configs.reduce_tile(10 ** 6, 256) == (configs.REDUCE_MAX_SPLITS, 16)


def test_split_kv_is_planned_from_the_sm_count():
    few = DeviceLimits(48 * 1024, 16, 64, (7, 0))
    many = DeviceLimits(228 * 1024, 132, 32, (9, 0))
    assert configs.choose_splits(few, 64 * 8, 8192, 16) == (1, 8192)  # the grid already fills 16 SMs
    splits, tokens = configs.choose_splits(many, 8, 32768, 16)
    assert splits * 8 <= 132 * configs.PROGRAMS_PER_SM < (splits + 1) * 8 * 2  # one wave, nearly full
    assert splits * tokens >= 32768 > (splits - 1) * tokens and tokens % 16 == 0
    assert configs.choose_splits(many, 32 * 8, 2048, 16) == (2, 1024)  # 256 programs -> 512: 4 per SM
    assert configs.choose_splits(many, 64 * 8, 8192, 16) == (1, 8192)  # 512 programs fill the wave
    assert configs.choose_splits(many, 8, 512, 16) == (8, 64)  # short: split down to 64 tokens
    assert configs.choose_splits(many, 8, 100, 16) == (1, 100)  # too short to split
    assert configs.choose_splits(many, 1, 10 ** 6, 16)[0] == configs.REDUCE_MAX_SPLITS  # one reduce load
    # at most the fused tile's splits where they still fill every SM and stay short
    assert configs.choose_splits(many, 64, 512, 16, 4) == (4, 128)     # (64, 8) 8 x 512: 256 programs
    assert configs.choose_splits(many, 8, 512, 16, 4) == (8, 64)       # 1 x 512: 32 would idle 100 SMs
    assert configs.choose_splits(many, 32, 2048, 16, 8) == (8, 256)    # MHA 1 x 2048
    assert configs.choose_splits(many, 32, 4096, 16, 8) == (16, 256)  # 512-token splits: too long


def test_bi_v100_limits_pick_48kb_configs_with_one_warp_of_64():
    for head_size in (32, 80, 128, 192, 256):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for kv_cache_dtype in ("auto", "fp8_e4m3"):
                config = configs.choose_config(BI_V100, head_size, 16, dtype, kv_cache_dtype, 8)
                assert config.num_warps == 1 and config.prefetch  # no async copies below capability 8.0
                assert config.num_stages == 1 and config.heads_block == 16
                assert configs.estimate_shared_bytes((7, 0), head_size, config.block_n, config.heads_block, dtype,
                                                     kv_cache_dtype, 1) <= 48 * 1024


def test_triton_2_keeps_to_the_configs_it_got_right(monkeypatch):
    """Triton 2.3.1 compiled the pipelined paths wrong on the H200, and crashed on 64-row programs: under
    Triton 2.x every config of an H200's figures is the kernel's own prefetch with one stage and at most
    16 query rows, grouped or not."""
    monkeypatch.setattr(configs, "triton_3", lambda: False)
    for group in (1, 4, 8, 64):
        for block_size in (8, 16, 32):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                config = configs.choose_config(H200, 128, block_size, dtype, "auto", group)
                assert config.prefetch and config.num_stages == 1 and config.heads_block <= 16
                assert not configs.key_rows(config, block_size) and not configs.unmasked_steps(config, 128)


@TRITON_3
def test_large_shared_memory_groups_query_heads_in_one_program():
    h200 = DeviceLimits(232448, 132, 32, (9, 0))
    assert configs.choose_config(h200, 128, 16, torch.float16, "auto", 8).heads_block == 16
    assert configs.choose_config(h200, 128, 16, torch.float16, "auto", 64).heads_block == 64
    with pytest.raises(ValueError, match="shared_memory_per_block"):
        configs.choose_config(DeviceLimits(1024, 16, 32, (7, 0)), 128, 16, torch.float16, "auto", 8)


def test_limits_narrowed_to_a_budget():
    limits = DeviceLimits(232448, 132, 32, (9, 0))
    assert limits.with_shared_memory_limit(49152).shared_memory_per_block == 49152
    assert limits.with_shared_memory_limit(None) is limits


@TRITON_3
def test_unmasked_steps_only_where_head_size_fills_the_tile():
    for head_size, expected in ((128, True), (64, True), (96, False), (120, False)):
        config = configs.choose_config(H200, head_size, 16, torch.float16, "auto", 4)
        assert configs.unmasked_steps(config, head_size) is expected
    assert not configs.unmasked_steps(configs.choose_config(H200, 128, 8, torch.float16, "auto", 1), 128)
    assert not configs.unmasked_steps(configs.choose_config(BI_V100, 128, 16, torch.float16, "auto", 4), 128)


@TRITON_3
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (64, 8), (128, 32)])
def test_unmasked_whole_steps_match_reference(head_size, block_size, device):
    """The pipelined path's unmasked loads: partial last steps, split-KV and v2 sub-splits, NaN past the ends
    and in spare blocks."""
    backend = get_backend("triton", limits=H200)
    assert configs.unmasked_steps(configs.choose_config(H200, head_size, block_size, torch.bfloat16, "auto", 4),
                                  head_size)
    inputs = golden.random_case(torch.bfloat16, head_size, block_size, 8, 2, [1, 47, 530], poison=True,
                                seed=block_size)
    ref = golden.reference_for(inputs)
    for version in golden.VERSIONS:
        golden.check_against_reference(golden.run_op(backend, inputs, version, device), ref,
                                       golden.random_tolerance(inputs))


@TRITON_3
def test_key_rows_only_on_the_pipelined_dot_path(monkeypatch):
    """K in its memory order: the pipelined tl.dot path with one cache block per step, and only where Triton
    has tl.permute (Triton 2.x, the BI-V100's 2.3.1 included, keeps the [dims, tokens] load). One query row
    per kv head takes that path too where K loads so, else float32 broadcast products."""
    config = lambda limits, block_size, group: configs.choose_config(  # noqa: E731
        limits, 128, block_size, torch.float16, "auto", group)
    for group in (4, 1):
        assert configs.key_rows(config(H200, 16, group), 16) and configs.key_rows(config(H200, 32, group), 32)
        assert not configs.key_rows(config(H200, 8, group), 8)  # a 16-token step spans two blocks of 8
        assert not configs.key_rows(config(BI_V100, 16, group), 16)  # the kernel's own prefetch
    assert config(H200, 16, 1).heads_block == 16 and not config(H200, 8, 1).use_dot
    monkeypatch.setattr(configs, "triton_has_permute", lambda: False)
    assert not configs.key_rows(config(H200, 16, 4), 16) and not config(H200, 16, 1).use_dot


@TRITON_3
@pytest.mark.parametrize("dtype,kv_cache_dtype,head_size,block_size", [
    (torch.float16, "auto", 96, 16),         # rows of dims past head_size masked
    (torch.bfloat16, "fp8_e4m3", 128, 32),   # X = 16 (one byte per element), 32-token blocks
    (torch.float16, "fp8_e5m2", 80, 16),
])
def test_key_rows_match_reference(dtype, kv_cache_dtype, head_size, block_size, device):
    """The K tiles loaded in memory order and permuted: masked dim rows, fp8's 16-element rows, partial steps,
    split-KV and v2 sub-splits, NaN in spare blocks and past the ends."""
    assert configs.key_rows(configs.choose_config(H200, head_size, block_size, dtype, kv_cache_dtype, 4), block_size)
    inputs = golden.random_case(dtype, head_size, block_size, 8, 2, [1, 33, 530], kv_cache_dtype=kv_cache_dtype,
                                poison=True, seed=head_size)
    ref = golden.reference_for(inputs)
    for version in golden.VERSIONS:
        golden.check_against_reference(golden.run_op(get_backend("triton", limits=H200), inputs, version, device),
                                       ref, golden.random_tolerance(inputs))


def test_unmasked_whole_steps_with_an_empty_cache(device):
    """No block to read: sequences that need one are NaN, empty ones zeros, and nothing is loaded."""
    inputs = golden.random_case(torch.float16, 128, 16, 4, 2, [0, 40], spare_blocks=0)
    inputs["key_cache"] = inputs["key_cache"][:0]
    inputs["value_cache"] = inputs["value_cache"][:0]
    for version in golden.VERSIONS:
        out = golden.run_op(get_backend("triton", limits=H200), inputs, version, device)["out"].cpu()
        assert torch.equal(out[0], torch.zeros(4, 128, dtype=torch.float16)) and torch.isnan(out[1]).all()


# --- edges ---------------------------------------------------------------------------------------

def test_seq_len_zero_gives_zeros_and_writes_no_partition(device):
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [0, 0, 700], poison=True)
    for backend in (BACKEND, SPLITTING):
        for version in golden.VERSIONS:
            outputs = golden.run_op(backend, inputs, version, device)
            assert torch.equal(outputs["out"][:2].cpu(), torch.zeros(2, 4, 64, dtype=torch.float16))
            golden.check_against_reference({k: v[2:] for k, v in outputs.items()},
                                           {k: v[2:] for k, v in golden.reference_for(inputs).items()},
                                           golden.random_tolerance(inputs))


def test_all_sequences_empty_and_no_sequences(device):
    inputs = golden.random_case(torch.bfloat16, 128, 16, 2, 1, [0, 0])
    for version in golden.VERSIONS:
        assert torch.equal(golden.run_op(BACKEND, inputs, version, device)["out"].cpu(),
                           torch.zeros(2, 2, 128, dtype=torch.bfloat16))
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [])
    inputs["max_seq_len"] = 0
    assert golden.run_op(BACKEND, inputs, "v2", device)["out"].shape == (0, 4, 64)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_nan_in_unused_slots_changes_nothing(kv_cache_dtype, device):
    golden.check_nan_in_unused_slots_changes_nothing(BACKEND, device, kv_cache_dtype)


def test_strided_tensors_give_the_same_result(device):
    golden.check_strided_tensors_give_the_same_result(BACKEND, device)


def test_scale_as_float_or_tensor(device):
    golden.check_scale_as_float_or_tensor(BACKEND, device, torch.float16, "fp8_e4m3")


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_decoding_of_every_bit_pattern(fmt, device):
    """Token t's V holds code t in dimension t (zeros elsewhere) and the query is zero, so each weight is
    1/256 and out[d] = decode(d) / 256 exactly: all 256 codes, NaN and infinities included."""
    inputs = golden.random_case(torch.float32, 256, 16, 1, 1, [256], kv_cache_dtype=fmt, spare_blocks=0)
    inputs["query"].zero_()
    value_cache = torch.zeros_like(inputs["value_cache"])
    for token in range(256):
        value_cache[int(inputs["block_tables"][0, token // 16]), 0, token, token % 16] = token
    inputs["value_cache"] = value_cache
    out = golden.run_op(BACKEND, inputs, "v1", device)["out"][0, 0].cpu().double()
    expected = fp8_bits_to_float64(torch.arange(256), fmt) / 256
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


BLOCKSPARSE = [
    # local_blocks, vert_stride, block_size, head_sliding_step, tp_rank
    (2, 4, 64, 1, 0),
    (1, 3, 32, -1, 1),
    (4, 16, 64, 0, 0),   # vert_stride * 64 > 512: some partitions are skipped entirely
]


@pytest.mark.parametrize("sparse", BLOCKSPARSE, ids=str)
def test_blocksparse_matches_reference(sparse, device):
    local_blocks, vert_stride, bs_block_size, sliding_step, tp_rank = sparse
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [5, 700, 2100], poison=True, seed=vert_stride)
    pattern = dict(local_blocks=local_blocks, vert_stride=vert_stride, block_size=bs_block_size,
                   head_sliding_step=sliding_step, tp_rank=tp_rank)
    ref = reference_attention(**inputs, blocksparse=pattern)
    for version in golden.VERSIONS:
        outputs = golden.run_op(BACKEND, inputs, version, device, **golden.blocksparse_keywords(pattern))
        golden.check_against_reference(outputs, ref, golden.random_tolerance(inputs))


# --- bad tables: NaN for the sequence concerned, never an out-of-bounds access -------------------

@pytest.mark.parametrize("breaker", golden.BAD_TABLE_BREAKERS, ids=lambda f: f.__name__)
def test_bad_table_gives_nan_for_that_sequence_only(breaker, device):
    inputs = golden.random_case(torch.float16, 64, 16, 4, 1, [100, 600, 40], poison=True)
    ref = golden.reference_for(inputs)
    breaker(inputs)
    for backend in (BACKEND, SPLITTING, get_backend("triton", limits=H200)):  # the last: unmasked whole steps
        for version in golden.VERSIONS:
            outputs = golden.run_op(backend, inputs, version, device)
            assert torch.isnan(outputs["out"][1]).all()
            if version == "v2":
                assert torch.isnan(outputs["max_logits"][1]).all() and torch.isnan(outputs["tmp_out"][1]).all()
            good = [0, 2]
            golden.check_against_reference({k: v[good] for k, v in outputs.items()},
                                           {k: v[good] for k, v in ref.items()}, golden.random_tolerance(inputs))


def test_plans_are_cached_per_shape(monkeypatch, device):
    calls = []
    plan = paged_attention_triton._plan
    monkeypatch.setattr(paged_attention_triton, "_plan", lambda *a: calls.append(a) or plan(*a))
    backend = get_backend("triton")
    inputs = golden.random_case(torch.float16, 64, 16, 4, 2, [10, 20])
    for _ in range(3):
        golden.run_op(backend, inputs, "v1", device)
    assert len(calls) == 1
