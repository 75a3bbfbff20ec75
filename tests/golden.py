"""Backend-agnostic test helpers: golden cases, random cases, running an op, checking it.

Every case is an ``inputs`` dict holding the op's arguments by name (query, key_cache, value_cache,
num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
k_scale, v_scale), the same format as ``case["inputs"]`` in the golden file. Typical use::

    from tests import golden
    backend = get_backend("triton")
    for case in golden.golden_cases():                      # or parametrize over golden.golden_case_names()
        outputs = golden.run_op(backend, case["inputs"], "v2", device)   # buffers prefilled with NaN
        golden.check_against_reference(outputs, golden.reference_for(case), golden.golden_tolerance(case, "v2"))

    inputs = golden.random_case(torch.float16, head_size=128, block_size=16, num_heads=8, num_kv_heads=2,
                                seq_lens=[1, 700], seed=0, poison=True)
    outputs = golden.run_op(backend, inputs, "v1", device, scale_as_tensor=True)
    golden.check_against_reference(outputs, golden.reference_for(inputs), golden.random_tolerance(inputs))

``check_against_reference`` asserts: out finite and within tolerance; for v2 also every written
partition entry (exp_sums relative, max_logits, tmp_out) finite and within tolerance, and every
unwritten entry still NaN. It returns the measured maximum errors.
"""

import dataclasses
import functools
import math

import torch

from tests.conftest import golden_dir
from tests.reference import PARTITION_SIZE, float_to_fp8_bits, reference_attention

GOLDEN_FILE = "golden_v2_public.pt"
VERSIONS = ("v1", "v2")


@functools.lru_cache(maxsize=1)
def load_golden():
    """The golden file's dict, or None when it is not there."""
    path = golden_dir() / GOLDEN_FILE
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)


def golden_cases():
    data = load_golden()
    return [] if data is None else data["cases"]


def golden_case_names():
    return [case["params"]["name"] for case in golden_cases()]


def golden_case(name):
    return next(case for case in golden_cases() if case["params"]["name"] == name)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed |ours - float64 reference|: atol + rtol * |ref|; exp_sums as a relative error."""

    out_atol: float
    out_rtol: float = 0.0
    max_logits_atol: float = math.inf
    exp_sums_rel: float = math.inf
    tmp_out_atol: float = math.inf
    tmp_out_rtol: float = 0.0


def golden_tolerance(case, version):
    """The issue's rule: no worse than 2x vLLM's own measured error against the float64 reference + 1e-5."""
    m = case["measured"]
    slack = lambda key: 2.0 * m[key] + 1e-5  # noqa: E731
    return Tolerance(out_atol=slack(f"max_abs_{version}_vs_ref"),
                     max_logits_atol=slack("max_abs_max_logits_vs_ref"),
                     exp_sums_rel=slack("max_rel_exp_sums_vs_ref"),
                     tmp_out_atol=slack("max_abs_tmp_out_vs_ref"))


def random_tolerance(inputs):
    """vLLM's test tolerances on its own distribution: atol 1e-3, rtol 1e-5; fp8 caches atol 1e-2."""
    atol = 1e-3 if inputs["kv_cache_dtype"] == "auto" else 1e-2
    return Tolerance(out_atol=atol, out_rtol=1e-5, max_logits_atol=atol, exp_sums_rel=atol,
                     tmp_out_atol=atol, tmp_out_rtol=1e-5)


_REFERENCE_CACHE = {}


def reference_for(case_or_inputs, blocksparse=None):
    """Float64 reference outputs (tests.reference) of a golden case or an inputs dict; cached per golden case."""
    if "inputs" in case_or_inputs:
        name = case_or_inputs["params"]["name"]
        if name not in _REFERENCE_CACHE:
            _REFERENCE_CACHE[name] = reference_attention(**case_or_inputs["inputs"])
        return _REFERENCE_CACHE[name]
    return reference_attention(**case_or_inputs, blocksparse=blocksparse)


def to_device(inputs, device, scale_as_tensor=False):
    """A copy of ``inputs`` with tensors on ``device``; k_scale/v_scale as 1-element float32 tensors if asked."""
    moved = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    if scale_as_tensor:
        for key in ("k_scale", "v_scale"):
            moved[key] = torch.tensor([float(inputs[key])], dtype=torch.float32, device=device)
    return moved


def nan_buffers(inputs, version, device):
    """The op's output buffers for ``inputs``, filled with NaN (so unwritten entries can be checked)."""
    query = inputs["query"]
    num_seqs, num_heads, head_size = query.shape
    buffers = {"out": torch.full(query.shape, math.nan, dtype=query.dtype, device=device)}
    if version == "v2":
        partitions = (inputs["max_seq_len"] + PARTITION_SIZE - 1) // PARTITION_SIZE
        shape = (num_seqs, num_heads, partitions)
        buffers["exp_sums"] = torch.full(shape, math.nan, dtype=torch.float32, device=device)
        buffers["max_logits"] = torch.full(shape, math.nan, dtype=torch.float32, device=device)
        buffers["tmp_out"] = torch.full(shape + (head_size,), math.nan, dtype=query.dtype, device=device)
    return buffers


def op_arguments(inputs):
    """The op's arguments after the output buffers, in vLLM's order."""
    return (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["num_kv_heads"], inputs["scale"],
            inputs["block_tables"], inputs["seq_lens"], inputs["block_size"], inputs["max_seq_len"],
            inputs["alibi_slopes"], inputs["kv_cache_dtype"], inputs["k_scale"], inputs["v_scale"])


def call_op(backend, version, buffers, inputs, **tail):
    """Call ``backend.paged_attention_<version>`` on tensors already in place (``tail``: tp_rank, blocksparse_*)."""
    if version == "v1":
        backend.paged_attention_v1(buffers["out"], *op_arguments(inputs), **tail)
    else:
        backend.paged_attention_v2(buffers["out"], buffers["exp_sums"], buffers["max_logits"], buffers["tmp_out"],
                                   *op_arguments(inputs), **tail)


def blocksparse_keywords(sparse):
    """The op's keyword arguments for ``sparse``, a block-sparse pattern as ``reference_attention`` takes it."""
    return dict(tp_rank=sparse["tp_rank"], blocksparse_local_blocks=sparse["local_blocks"],
                blocksparse_vert_stride=sparse["vert_stride"], blocksparse_block_size=sparse["block_size"],
                blocksparse_head_sliding_step=sparse["head_sliding_step"])


def run_op(backend, inputs, version, device, scale_as_tensor=False, **tail):
    """Move ``inputs`` to ``device``, run the op into NaN-filled buffers, return the buffers."""
    on_device = to_device(inputs, device, scale_as_tensor)
    buffers = nan_buffers(on_device, version, device)
    call_op(backend, version, buffers, on_device, **tail)
    return buffers


def _max(tensor):
    return float(tensor.max()) if tensor.numel() else 0.0


def check_against_reference(outputs, ref, tolerance):
    """Assert the issue's rules (module docstring); return the max errors found, by output name."""
    out = outputs["out"].detach().cpu().double()
    assert torch.isfinite(out).all(), "out holds non-finite values"
    excess = (out - ref["out"]).abs() - tolerance.out_rtol * ref["out"].abs()
    errors = {"out": _max((out - ref["out"]).abs())}
    assert _max(excess) <= tolerance.out_atol, f"out: max error {errors['out']:.3g} > {tolerance.out_atol:.3g}"
    if "exp_sums" not in outputs:
        return errors
    written = ref["written"]
    partitions = written.shape[2]
    for name in ("max_logits", "exp_sums", "tmp_out"):
        ours = outputs[name].detach().cpu().double()[:, :, :partitions]
        assert torch.isnan(ours[~written]).all(), f"{name}: a partition past its sequence was written"
        assert torch.isnan(outputs[name].detach().cpu()[:, :, partitions:]).all(), f"{name}: written past max_seq_len"
        ours, theirs = ours[written], ref[name][written]
        assert torch.isfinite(ours).all(), f"{name}: a written entry is not finite"
        if name == "max_logits":
            errors[name] = _max((ours - theirs).abs())
            assert errors[name] <= tolerance.max_logits_atol, f"max_logits: max error {errors[name]:.3g}"
        elif name == "exp_sums":
            errors[name] = _max(((ours - theirs) / theirs).abs())
            assert errors[name] <= tolerance.exp_sums_rel, f"exp_sums: max relative error {errors[name]:.3g}"
        else:
            errors[name] = _max((ours - theirs).abs())
            excess = (ours - theirs).abs() - tolerance.tmp_out_rtol * theirs.abs()
            assert _max(excess) <= tolerance.tmp_out_atol, f"tmp_out: max error {errors[name]:.3g}"
    return errors


def _alibi_like_vllm_test(num_heads, generator):
    return torch.randn(num_heads, generator=generator, dtype=torch.float32)


def random_case(dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, seed=0, alibi=False,
                kv_cache_dtype="auto", poison=False, spare_blocks=3, pad_cols=1, k_scale=1.0, v_scale=1.0,
                max_seq_len=None):
    """A random paged case on vLLM's test distribution (query and caches uniform in +-head_size**-0.5).

    Used blocks come from a random permutation of the physical blocks (non-contiguous, out of order);
    unused table columns point at random blocks (often spare ones). ``poison`` puts NaN (byte 0x7F for
    fp8) in the slots past each sequence's end and in the spare blocks. fp8 caches hold uint8 bit
    patterns of values drawn uniform in +-scale (before dividing by k_scale / v_scale).
    """
    generator = torch.Generator().manual_seed(seed)
    scale = head_size ** -0.5
    num_seqs = len(seq_lens)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    if max_seq_len is None:
        max_seq_len = max(seq_lens, default=0)
    columns = (max_seq_len + block_size - 1) // block_size + pad_cols
    permutation = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.randint(0, num_blocks, (num_seqs, columns), generator=generator, dtype=torch.int32)
    next_block = 0
    for s, count in enumerate(blocks_per_seq):
        block_tables[s, :count] = permutation[next_block:next_block + count]
        next_block += count
    spare = permutation[next_block:].long()

    def uniform(shape):
        return torch.rand(shape, generator=generator, dtype=torch.float64) * (2 * scale) - scale

    x = 16 // (1 if kv_cache_dtype != "auto" else torch.empty((), dtype=dtype).element_size())
    key_values = uniform((num_blocks, num_kv_heads, head_size // x, block_size, x))
    value_values = uniform((num_blocks, num_kv_heads, head_size, block_size))
    if kv_cache_dtype == "auto":
        key_cache, value_cache, nan = key_values.to(dtype), value_values.to(dtype), math.nan
    else:
        fmt = "fp8_e4m3" if kv_cache_dtype in ("fp8", "fp8_e4m3") else kv_cache_dtype
        key_cache = float_to_fp8_bits(key_values / k_scale, fmt)
        value_cache = float_to_fp8_bits(value_values / v_scale, fmt)
        nan = 0x7F
    if poison:
        key_cache[spare] = nan
        value_cache[spare] = nan
        for s, length in enumerate(seq_lens):
            if length % block_size:
                tail_block = int(block_tables[s, length // block_size])
                key_cache[tail_block, :, :, length % block_size:, :] = nan
                value_cache[tail_block, :, :, length % block_size:] = nan
    return {
        "query": uniform((num_seqs, num_heads, head_size)).to(dtype),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "num_kv_heads": num_kv_heads,
        "scale": scale,
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_size": block_size,
        "max_seq_len": max_seq_len,
        "alibi_slopes": _alibi_like_vllm_test(num_heads, generator) if alibi else None,
        "kv_cache_dtype": kv_cache_dtype,
        "k_scale": k_scale,
        "v_scale": v_scale,
    }


def non_contiguous(tensor, dims):
    """The same values as ``tensor`` in a view whose ``dims`` have twice the usual stride; the gaps hold NaN."""
    shape = list(tensor.shape)
    for dim in dims:
        shape[dim] *= 2
    fill = 0x7F if tensor.dtype == torch.uint8 else math.nan
    big = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    view = big[tuple(slice(None, None, 2) if dim in dims else slice(None) for dim in range(tensor.dim()))]
    view.copy_(tensor)
    return view


# Checks every backend must pass, called from each backend's test file.

def check_nan_in_unused_slots_changes_nothing(backend, device, kv_cache_dtype):
    """NaN in tail slots and unused blocks leaves every output exactly as it is without it."""
    args = (torch.bfloat16, 64, 8, 8, 2, [3, 515])  # 515: a 3-token second partition, 5 spare tail slots
    clean = random_case(*args, kv_cache_dtype=kv_cache_dtype, seed=7)
    poisoned = random_case(*args, kv_cache_dtype=kv_cache_dtype, seed=7, poison=True)
    assert not torch.equal(clean["value_cache"], poisoned["value_cache"])
    for version in VERSIONS:
        expected = run_op(backend, clean, version, device)
        actual = run_op(backend, poisoned, version, device)
        for name, tensor in expected.items():
            assert torch.equal(actual[name].isnan(), tensor.isnan())
            assert torch.equal(actual[name].nan_to_num(), tensor.nan_to_num()), name


def check_strided_tensors_give_the_same_result(backend, device):
    """Non-contiguous query, caches, block tables and output buffers give the contiguous result bit for bit."""
    inputs = to_device(random_case(torch.float16, 128, 16, 4, 2, [20, 700], poison=True), device)
    expected = nan_buffers(inputs, "v2", device)
    call_op(backend, "v2", expected, inputs)
    strided = dict(inputs)
    strided["query"] = non_contiguous(inputs["query"], dims=(0, 2))
    strided["key_cache"] = non_contiguous(inputs["key_cache"], dims=(0, 1))
    strided["value_cache"] = non_contiguous(inputs["value_cache"], dims=(1, 3))
    strided["block_tables"] = inputs["block_tables"].t().contiguous().t()
    buffers = {name: non_contiguous(tensor, dims=(0, 1)) for name, tensor in nan_buffers(inputs, "v2", device).items()}
    call_op(backend, "v2", buffers, strided)
    for name, tensor in expected.items():
        assert not buffers[name].is_contiguous()
        assert torch.equal(buffers[name].nan_to_num(), tensor.nan_to_num()), name
        assert torch.equal(buffers[name].isnan(), tensor.isnan()), name


def check_scale_as_float_or_tensor(backend, device, dtype, kv_cache_dtype):
    """k_scale/v_scale as Python floats (vLLM <= 0.6.6) and as device tensors (>= 0.7) give the same outputs."""
    inputs = random_case(dtype, 64, 16, 4, 1, [40, 600], kv_cache_dtype=kv_cache_dtype, k_scale=0.02, v_scale=0.03,
                         poison=True)
    ref = reference_for(inputs)
    for version in VERSIONS:
        as_float = run_op(backend, inputs, version, device)
        as_tensor = run_op(backend, inputs, version, device, scale_as_tensor=True)
        check_against_reference(as_float, ref, random_tolerance(inputs))
        for name, tensor in as_float.items():
            assert torch.equal(as_tensor[name].nan_to_num(), tensor.nan_to_num()), name


# Ways to break a block table or a sequence length; each touches sequence 1 only, and a backend must
# give NaN for that sequence, never read or write out of bounds (or, validating, raise first).

def entry_too_large(inputs):
    inputs["block_tables"][1, 1] = inputs["key_cache"].shape[0]


def entry_negative(inputs):
    inputs["block_tables"][1, 0] = -5


def too_few_columns(inputs):
    inputs["seq_lens"][1] = inputs["block_tables"].shape[1] * inputs["block_size"] + 1
    inputs["max_seq_len"] = int(inputs["seq_lens"].max())


def longer_than_max_seq_len(inputs):
    inputs["seq_lens"][1] = inputs["max_seq_len"] + 1


BAD_TABLE_BREAKERS = (entry_too_large, entry_negative, too_few_columns, longer_than_max_seq_len)
