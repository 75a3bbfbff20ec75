"""Our ops behind ``torch.ops._C.paged_attention_v1/v2`` too, for code that calls the dispatcher directly.

vLLM's own tests (and some integrations) call ``torch.ops._C.paged_attention_vN`` rather than
``vllm._custom_ops``. We register our implementation for the device's dispatch key with
``torch.library.Library("_C", "IMPL")`` (overriding vLLM's kernel for that key), and where
``vllm._C`` did not load (no compiled extension for this device) we first define the family's
schema in a ``"FRAGMENT"`` library so that the name exists. Both APIs exist from torch 2.1 on.
The ``Library`` objects are kept: dropping them takes the registrations out again.
"""

import logging
import warnings

import torch

from .families import OP_NAMES

logger = logging.getLogger("biv100_patch")

# The C++ schema names the v2 buffer exp_sums; the Python function says exp_sum.
_SCHEMA_TO_PYTHON = {"exp_sums": "exp_sum"}


def device_dispatch_key():
    """``CUDA`` on any CUDA-like device (Iluvatar's and AMD's torch use it too), else ``CPU``."""
    return "CUDA" if torch.cuda.is_available() else "CPU"


def _existing_op(name):
    try:
        return getattr(torch.ops._C, name).default
    except (AttributeError, RuntimeError):
        return None


def _argument_names(op):
    return tuple(argument.name for argument in op._schema.arguments)


def _expected_names(family, name):
    return tuple("exp_sums" if p == "exp_sum" else p for p in family.params(name))


def _make_impl(python_function, names):
    """A dispatcher kernel: positional schema arguments -> ``python_function``'s keywords."""
    keywords = tuple(_SCHEMA_TO_PYTHON.get(n, n) for n in names)

    def impl(*args):
        python_function(**dict(zip(keywords, args)))

    return impl


def _drop_library(library):
    destroy = getattr(library, "_destroy", None)
    if destroy is not None:  # torch >= 2.3
        destroy()
        return
    # torch 2.1/2.2: releasing the C++ handle deregisters; keep __del__ from doing it twice.
    import torch.library
    for registry, own in (("_impls", "_op_impls"), ("_defs", "_op_defs")):
        for key in getattr(library, own, ()):
            getattr(torch.library, registry, set()).discard(key)
        if hasattr(library, own):
            setattr(library, own, set())
    library.m = None


class Registration:
    """The dispatcher side of one applied patch; ``remove()`` takes it out again."""

    def __init__(self, libraries, dispatch_key, defined, replaced):
        self._libraries = libraries
        self.dispatch_key = dispatch_key
        self.defined = defined     # op names whose schema we defined (vllm._C absent)
        self.replaced = replaced   # op names whose existing kernel for dispatch_key we override

    def as_dict(self):
        return {"dispatch_key": self.dispatch_key, "defined": list(self.defined), "replaced": list(self.replaced)}

    def remove(self):
        for library in reversed(self._libraries):
            _drop_library(library)
        self._libraries = []
        namespace = torch.ops._C
        for name in self.defined:  # torch < 2.3 keeps a cached packet for an op that no longer exists
            if name in vars(namespace):
                delattr(namespace, name)


def register(family, functions, dispatch_key=None):
    """Route ``torch.ops._C.<op>`` for ``dispatch_key`` to ``functions`` (op name -> Python function
    with the backend's keyword names). Raises ``RuntimeError`` when an existing schema is not the
    family's (then nothing is registered)."""
    dispatch_key = dispatch_key or device_dispatch_key()
    existing = {name: _existing_op(name) for name in OP_NAMES}
    for name, op in existing.items():
        if op is not None and _argument_names(op) != _expected_names(family, name):
            raise RuntimeError(f"torch.ops._C.{name} has the schema {op._schema}, not the {family.name} family's")
    libraries = []
    defined = [name for name, op in existing.items() if op is None]
    try:
        if defined:
            fragment = torch.library.Library("_C", "FRAGMENT")
            libraries.append(fragment)
            for name in defined:
                fragment.define(family.schema(name))
        implementation = torch.library.Library("_C", "IMPL")
        libraries.append(implementation)
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name in OP_NAMES:
                op = _existing_op(name)
                implementation.impl(name, _make_impl(functions[name], _argument_names(op)), dispatch_key)
    except Exception:
        for library in reversed(libraries):
            _drop_library(library)
        raise
    return Registration(libraries, dispatch_key, defined, [n for n in OP_NAMES if n not in defined])
