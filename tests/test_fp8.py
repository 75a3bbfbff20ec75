"""kernels.fp8: the portable decode tables against an independent decoder and torch's float8 dtypes."""

import math

import pytest
import torch

from kernels import fp8
from tests.reference import fp8_bits_to_float64

CODES = torch.arange(256, dtype=torch.uint8)
TORCH_FLOAT8 = {"fp8_e4m3": getattr(torch, "float8_e4m3fn", None), "fp8_e5m2": getattr(torch, "float8_e5m2", None)}


@pytest.mark.parametrize("fmt", sorted(fp8.FORMATS))
def test_table_matches_the_reference_decoder(fmt):
    table = fp8.decode_table(fmt, "cpu").double()
    expected = fp8_bits_to_float64(CODES, fmt)
    assert torch.equal(table.isnan(), expected.isnan())
    assert torch.equal(table.nan_to_num(), expected.nan_to_num())
    if TORCH_FLOAT8[fmt] is not None:
        assert torch.equal(table.nan_to_num(), CODES.view(TORCH_FLOAT8[fmt]).double().nan_to_num())


def test_special_values():
    e4m3, e5m2 = fp8.decode_table("fp8", "cpu"), fp8.decode_table("fp8_e5m2", "cpu")
    assert torch.isnan(e4m3).nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert float(e4m3[0x7E]) == 448.0 and float(e4m3[0x01]) == 2.0 ** -9
    assert float(e5m2[0x7C]) == math.inf and float(e5m2[0xFC]) == -math.inf
    assert float(e5m2[0x7B]) == 57344.0 and float(e5m2[0x01]) == 2.0 ** -16
    assert fp8.decode_table("fp8", "cpu") is fp8.decode_table("fp8_e4m3", torch.device("cpu"))  # cached


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(fp8.FORMATS))
def test_scaled_decode_follows_vllms_rounding(fmt, dtype):
    scale = 0.0173
    # vLLM: fp8 -> half -> float, times the float32 scale in float32, rounded to the query dtype.
    expected = (fp8_bits_to_float64(CODES, fmt).half().float() * torch.tensor(scale, dtype=torch.float32)).to(dtype)
    bits = CODES.reshape(4, 8, 8)
    for given in (scale, torch.tensor([scale]), torch.tensor(scale)):
        decoded = fp8.decode(bits, fmt, given, dtype)
        assert decoded.dtype == dtype and decoded.shape == bits.shape
        assert torch.equal(decoded.flatten().isnan(), expected.isnan())
        assert torch.equal(decoded.flatten().nan_to_num(), expected.nan_to_num())


def test_unknown_format():
    with pytest.raises(ValueError, match="^fmt: "):
        fp8.decode_table("fp8_e3m4", "cpu")
