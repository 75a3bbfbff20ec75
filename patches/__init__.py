"""The patcher: vLLM's paged_attention_v1/v2 replaced by our Triton or PyTorch backend.

Public API (cheap to import: torch, triton, vllm and even packaging load only when a function
is called, since the import hook imports this package in every interpreter)::

    apply(backend="auto")        -> decision dict {"backend", "reason", ...}
    revert()                     -> True when something was put back
    state()                      -> what the patch did in this process (JSON-ready dict)
    on_custom_ops_loaded(module) -> the import hook's call after vllm._custom_ops has executed

``apply()`` before vLLM is imported takes effect when ``vllm._custom_ops`` is imported.
See ``patches/apply.py`` for the details.
"""

import sys

__all__ = ["apply", "revert", "state", "on_custom_ops_loaded"]


def _implementation():
    module = sys.modules.get(__name__ + ".apply")
    if module is None:
        import importlib  # not at module level: it pulls in warnings, ~1 ms of every interpreter start

        module = importlib.import_module(__name__ + ".apply")
        # Importing the submodule bound the name "apply" on this package to it: put the function back.
        globals()["apply"] = _public_apply
    return module


def apply(backend="auto"):
    """Patch vLLM with ``backend`` (auto, triton, torch or off); returns the decision."""
    return _implementation().apply(backend)


def revert():
    """Put back exactly what ``apply()`` replaced; True when something was reverted."""
    return _implementation().revert()


def state():
    """What the patch did in this process (a JSON-ready dict)."""
    return _implementation().state()


def on_custom_ops_loaded(module):
    """For the import hook: patch ``module`` (``vllm._custom_ops``, just executed). Never raises."""
    return _implementation().on_custom_ops_loaded(module)


_public_apply = apply
