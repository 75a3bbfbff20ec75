"""vLLM's ``paged_attention_v1``/``_v2`` signature families, and which one an installed vLLM has.

Four families between 0.4.2 and 0.24.x differ only in the arguments after ``kv_cache_dtype``::

    0.4.2          kv_scale: float                                   (vllm._C.ops, pybind)
    0.4.3-0.5.2    kv_scale: float, tp_rank, blocksparse_* (4)       (0.4.3 pybind, 0.5.x torch.ops._C)
    0.5.3-0.6.6    k_scale: float, v_scale: float, tp_rank, blocksparse_*        (torch.ops._C)
    0.7.0-0.24.x   k_scale: Tensor, v_scale: Tensor, tp_rank, blocksparse_*      (torch.ops._C)

0.25 removed both ops. 0.5.2-0.6.3 wrap every function of ``vllm._custom_ops`` in
``hint_on_error`` (``functools.wraps``, so ``inspect.signature`` sees the wrapped function).
A family is chosen from the distribution's version (``importlib.metadata``: an install from
source can report ``vllm.__version__ == "dev"``; a ``+corex`` local or ``.postN`` release counts
as its base) and then confirmed against the functions' real signatures. No torch import here.
"""

import inspect

from packaging.version import InvalidVersion, Version

OP_NAMES = ("paged_attention_v1", "paged_attention_v2")
V1_HEAD = ("out", "query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables", "seq_lens",
           "block_size", "max_seq_len", "alibi_slopes", "kv_cache_dtype")
V2_HEAD = ("out", "exp_sum", "max_logits", "tmp_out") + V1_HEAD[1:]
TP_AND_BLOCKSPARSE = ("tp_rank", "blocksparse_local_blocks", "blocksparse_vert_stride", "blocksparse_block_size",
                      "blocksparse_head_sliding_step")
FIRST_SUPPORTED = Version("0.4.2")
FIRST_WITHOUT_OPS = Version("0.25.0")
FIRST_WITH_DISPATCHER = Version("0.5.0")  # 0.4.x called pybind functions, not torch.ops._C


class Family:
    """One signature family: versions ``[first, end)`` and the arguments after ``kv_cache_dtype``."""

    def __init__(self, name, first, end, scale_names, scale_type, has_tail):
        self.name = name
        self.first = Version(first)
        self.end = Version(end)
        self.scale_names = scale_names          # ("kv_scale",) or ("k_scale", "v_scale")
        self.scale_type = scale_type            # "float" or "tensor"
        self.tail = scale_names + (TP_AND_BLOCKSPARSE if has_tail else ())

    def __repr__(self):
        return f"<vLLM signature family {self.name}>"

    def params(self, op_name):
        return (V1_HEAD if op_name == "paged_attention_v1" else V2_HEAD) + self.tail

    def covers(self, version):
        return self.first <= version < self.end

    def uses_dispatcher(self, version):
        return version >= FIRST_WITH_DISPATCHER

    def schema(self, op_name):
        """The ``_C::`` schema vLLM's C++ extension registers for this family (0.5.0 on)."""
        scale = "float" if self.scale_type == "float" else "Tensor"
        types = {"out": "Tensor! out", "exp_sum": "Tensor! exp_sums", "max_logits": "Tensor! max_logits",
                 "tmp_out": "Tensor! tmp_out", "num_kv_heads": "int num_kv_heads", "scale": "float scale",
                 "block_size": "int block_size", "max_seq_len": "int max_seq_len",
                 "alibi_slopes": "Tensor? alibi_slopes", "kv_cache_dtype": "str kv_cache_dtype"}
        arguments = []
        for name in self.params(op_name):
            if name in types:
                arguments.append(types[name])
            elif name in self.scale_names:
                arguments.append(f"{scale} {name}")
            elif name in TP_AND_BLOCKSPARSE:
                arguments.append(f"int {name}")
            else:
                arguments.append(f"Tensor {name}")
        return f"{op_name}({', '.join(arguments)}) -> ()"


FAMILIES = (
    Family("0.4.2", "0.4.2", "0.4.3", ("kv_scale",), "float", has_tail=False),
    Family("0.4.3-0.5.2", "0.4.3", "0.5.3", ("kv_scale",), "float", has_tail=True),
    Family("0.5.3-0.6.6", "0.5.3", "0.7.0", ("k_scale", "v_scale"), "float", has_tail=True),
    Family("0.7.0-0.24.x", "0.7.0", "0.25.0", ("k_scale", "v_scale"), "tensor", has_tail=True),
)


class Match:
    """What ``classify`` found: the family (None: patch nothing) and the reason in one sentence."""

    def __init__(self, family, reason, version=None, raw_version=None, wrapped=False):
        self.family = family
        self.reason = reason
        self.version = version            # packaging Version of the base release, or None
        self.raw_version = raw_version    # the distribution's version string, or None
        self.wrapped = wrapped            # True when the attributes are hint_on_error wrappers

    def as_dict(self):
        return {"family": self.family.name if self.family else None, "vllm_version": self.raw_version,
                "hint_on_error": self.wrapped}


def installed_version():
    """The vllm distribution's version string, or None when it is not installed."""
    from importlib import metadata
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def base_version(raw):
    """``0.6.3+corex.3.2.3`` and ``0.6.3.post1`` -> ``Version("0.6.3")``; None when unparsable."""
    try:
        return Version(Version(raw).base_version)
    except (InvalidVersion, TypeError):
        return None


def family_for_version(version):
    for family in FAMILIES:
        if family.covers(version):
            return family
    return None


def version_verdict(raw):
    """``(family or None, Version or None, reason)`` from the version alone (no import of vLLM)."""
    if raw is None:
        return None, None, "vLLM is not installed"
    version = base_version(raw)
    if version is None:
        return None, None, f"vLLM's version {raw!r} cannot be parsed"
    if version >= FIRST_WITHOUT_OPS:
        return None, version, (f"vLLM {raw} has no paged_attention_v1/v2 (removed in 0.25): nothing to patch; "
                               "its own attention backends are used")
    family = family_for_version(version)
    if family is None:
        return None, version, f"vLLM {raw} is older than {FIRST_SUPPORTED}, the oldest version supported"
    return family, version, f"vLLM {raw} is in the {family.name} signature family"


def _scale_kind(annotation):
    """"float", "tensor" or None (no annotation, or one we cannot read)."""
    if annotation is inspect.Parameter.empty:
        return None
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__qualname__", repr(annotation))
    if text == "float":
        return "float"
    if text.split(".")[-1] == "Tensor":
        return "tensor"
    return None


def signature_mismatch(family, op_name, function):
    """None when ``function`` has ``family``'s signature for ``op_name``, else what differs."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as error:
        return f"{op_name} has no readable signature ({error})"
    names = tuple(signature.parameters)
    expected = family.params(op_name)
    if names != expected:
        return f"{op_name}({', '.join(names)}) is not the expected ({', '.join(expected)})"
    for name in family.scale_names:
        kind = _scale_kind(signature.parameters[name].annotation)
        if kind is not None and kind != family.scale_type:
            return f"{op_name}'s {name} is annotated {kind}, the {family.name} family passes a {family.scale_type}"
    return None


def _is_wrapped(function):
    return getattr(function, "__wrapped__", None) is not None


def classify(raw_version, module):
    """Which family ``module`` (a loaded ``vllm._custom_ops``) belongs to, from version and signatures."""
    family, version, reason = version_verdict(raw_version)
    functions = [getattr(module, name, None) for name in OP_NAMES]
    wrapped = any(_is_wrapped(function) for function in functions if function is not None)
    if family is None and raw_version is None:
        # No distribution metadata (a source tree on sys.path): the signatures alone must decide.
        candidates = [f for f in FAMILIES
                      if all(fn is not None and signature_mismatch(f, name, fn) is None
                             for name, fn in zip(OP_NAMES, functions))]
        if len(candidates) != 1:
            return Match(None, "vLLM has no distribution metadata and its signatures match "
                         f"{len(candidates)} families", wrapped=wrapped)
        family = candidates[0]
        return Match(family, f"vLLM without distribution metadata has the {family.name} signatures",
                     wrapped=wrapped)
    if family is None:
        return Match(None, reason, version, raw_version, wrapped)
    missing = [name for name, function in zip(OP_NAMES, functions) if not callable(function)]
    if missing:
        return Match(None, f"vLLM {raw_version}'s vllm._custom_ops has no {' or '.join(missing)}: nothing to patch",
                     version, raw_version, wrapped)
    for name, function in zip(OP_NAMES, functions):
        mismatch = signature_mismatch(family, name, function)
        if mismatch:
            return Match(None, f"vLLM {raw_version}: unexpected signature: {mismatch}; nothing patched",
                         version, raw_version, wrapped)
    return Match(family, reason, version, raw_version, wrapped)


def make_replacements(family, ops):
    """``(paged_attention_v1, paged_attention_v2)`` with ``family``'s exact signature, calling ``ops``.

    ``ops`` has the backend signature (``k_scale, v_scale`` and the tp/blocksparse tail). vLLM
    calls these positionally, so the parameter names and order are the family's own.
    """
    if family.tail == ("kv_scale",):
        def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                               block_size, max_seq_len, alibi_slopes, kv_cache_dtype, kv_scale):
            ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                   seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, kv_scale,
                                   kv_scale)

        def paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                               scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                               kv_cache_dtype, kv_scale):
            ops.paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                                   scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                                   kv_cache_dtype, kv_scale, kv_scale)
    elif family.scale_names == ("kv_scale",):
        def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                               block_size, max_seq_len, alibi_slopes, kv_cache_dtype, kv_scale, tp_rank=0,
                               blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                               blocksparse_head_sliding_step=0):
            ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                   seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, kv_scale,
                                   kv_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                                   blocksparse_block_size, blocksparse_head_sliding_step)

        def paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                               scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                               kv_cache_dtype, kv_scale, tp_rank=0, blocksparse_local_blocks=0,
                               blocksparse_vert_stride=0, blocksparse_block_size=64,
                               blocksparse_head_sliding_step=0):
            ops.paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                                   scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                                   kv_cache_dtype, kv_scale, kv_scale, tp_rank, blocksparse_local_blocks,
                                   blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step)
    else:
        def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                               block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                               blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                               blocksparse_head_sliding_step=0):
            ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                                   seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                                   v_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                                   blocksparse_block_size, blocksparse_head_sliding_step)

        def paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                               scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                               kv_cache_dtype, k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0,
                               blocksparse_vert_stride=0, blocksparse_block_size=64,
                               blocksparse_head_sliding_step=0):
            ops.paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                                   scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                                   kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse_local_blocks,
                                   blocksparse_vert_stride, blocksparse_block_size, blocksparse_head_sliding_step)
    for function in (paged_attention_v1, paged_attention_v2):
        function.biv100_patch = ops  # marks our functions (and says which backend runs them)
        function.__qualname__ = function.__name__
    return paged_attention_v1, paged_attention_v2
