"""Portable fp8 cache decoding: a 256-entry lookup table, no float8 dtypes or fp8 hardware needed.

vLLM's rule for an fp8 cache element: fp8 -> half -> float, times k_scale / v_scale in float32,
rounded to the query dtype. fp8 -> half is exact for both formats, so the table holds the exact
values as float32. Because the rule is applied per value, it can be applied to the 256 table
entries once per call (``scaled_table``) and the cache decoded with a single gather.

    decode_table(fmt, device)                -> float32 [256], cached per (format, device); Triton loads from it
    scaled_table(fmt, scale, dtype, device)  -> dtype   [256], round(table * scale) (scale: float or tensor)
    lookup(table, bits)                      -> table[bits] for a uint8 tensor (int32 indices, no int64 copy)
    decode(bits, fmt, scale, dtype)          -> dtype tensor shaped like ``bits`` (uint8)

``fmt`` is "fp8_e4m3" (``torch.float8_e4m3fn`` bits; vLLM's "fp8") or "fp8_e5m2".
"""

import math

import torch

FORMATS = {
    # name: (exponent bits, mantissa bits, exponent bias, top exponent holds only NaN/inf (IEEE-like))
    "fp8_e4m3": (4, 3, 7, False),
    "fp8_e5m2": (5, 2, 15, True),
}
_ALIASES = {"fp8": "fp8_e4m3"}
_TABLES = {}


def _format(fmt):
    fmt = _ALIASES.get(fmt, fmt)
    if fmt not in FORMATS:
        raise ValueError(f"fmt: must be one of {', '.join(FORMATS)} (or 'fp8'); got {fmt!r}")
    return fmt


def _value(code, exponent_bits, mantissa_bits, bias, ieee_specials):
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    top = (1 << exponent_bits) - 1
    if ieee_specials and exponent == top:  # e5m2: inf and NaN like IEEE half
        return sign * math.inf if mantissa == 0 else math.nan
    if not ieee_specials and exponent == top and mantissa == (1 << mantissa_bits) - 1:  # e4m3fn: only S.1111.111
        return math.nan
    if exponent == 0:  # subnormal
        return sign * math.ldexp(mantissa, 1 - bias - mantissa_bits)
    return sign * math.ldexp((1 << mantissa_bits) + mantissa, exponent - bias - mantissa_bits)


def table_values(fmt):
    """The 256 decoded values of ``fmt`` as Python floats, index = bit pattern."""
    spec = FORMATS[_format(fmt)]
    return [_value(code, *spec) for code in range(256)]


def decode_table(fmt, device):
    """float32 [256] on ``device``: entry b is the value of fp8 bit pattern b (exact)."""
    key = (_format(fmt), torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(table_values(key[0]), dtype=torch.float32, device=key[1])
        _TABLES[key] = table
    return table


def scaled_table(fmt, scale, dtype, device):
    """``dtype`` [256]: vLLM's decoded value of each bit pattern, ``round_to_dtype(float32 value * scale)``.

    ``scale`` may be a float or a one-element float32 tensor (kept on the device: no host sync).
    """
    table = decode_table(fmt, device)
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(()).to(device=table.device, dtype=torch.float32)
    return (table * scale).to(dtype)


def lookup(table, bits):
    """``table[bits]`` for a uint8 tensor of bit patterns (index_select takes int32 indices as they are)."""
    return torch.index_select(table, 0, bits.reshape(-1).to(torch.int32)).view(bits.shape)


def decode(bits, fmt, scale, dtype):
    """Decode a uint8 tensor of fp8 bit patterns into ``dtype`` values times ``scale`` (vLLM's rounding)."""
    return lookup(scaled_table(fmt, scale, dtype, bits.device), bits)
