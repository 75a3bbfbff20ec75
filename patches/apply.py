"""Apply and revert the patch: one lock, one state, idempotent, never harmful to the process.

``apply()`` replaces ``vllm._custom_ops.paged_attention_v1/v2`` (and their ``torch.ops._C``
dispatcher entries) with the backend the probe chose. Called before vLLM is imported, it takes
effect when ``vllm._custom_ops`` is imported: the import hook (``_startup``) calls
``on_custom_ops_loaded(module)`` right after that module has executed. Nothing here raises into
vLLM: a failure is logged once at WARNING, kept in ``state()`` and vLLM runs unpatched.
"""

import importlib.util
import logging
import sys
import threading
import types

from . import families

logger = logging.getLogger("biv100_patch")

CUSTOM_OPS = "vllm._custom_ops"
BACKENDS = ("auto", "triton", "torch", "off")

_lock = threading.RLock()
_warned = set()
_patch = None       # the applied _Patch, if any
_requested = None   # the backend asked for by apply() while vllm._custom_ops was not imported yet
_state = {"status": "idle", "reason": "apply() has not been called"}
_announced = False


class _Patch:
    """What one apply changed: the module's original attributes and the dispatcher registration."""

    def __init__(self, module, originals, replacements, ops, registration):
        self.module = module
        self.originals = originals
        self.replacements = replacements
        self.ops = ops
        self.registration = registration

    def undo(self):
        for name, original in self.originals.items():
            if getattr(self.module, name, None) is self.replacements[name]:
                setattr(self.module, name, original)
            else:
                logger.warning("biv100-patch: %s.%s was replaced by someone else since; left as it is",
                               CUSTOM_OPS, name)
        if self.registration is not None:
            self.registration.remove()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        logger.warning("biv100-patch: %s", message)


def _set_state(status, reason, **details):
    global _state
    _state = {"status": status, "reason": reason, **details}


def state():
    """What the patch did in this process, as a JSON-ready dict (a copy).

    ``status``: ``idle`` (never applied), ``pending`` (waiting for ``vllm._custom_ops``),
    ``patched``, ``skipped`` (nothing patched, see ``reason``: vLLM missing or unsupported, the
    decision was ``off``), ``failed`` (an error, see ``reason``), ``reverted``. When patched:
    ``backend``, ``decision``, ``vllm_version``, ``family``, ``hint_on_error``, ``dispatcher``
    and ``routed_to_torch`` (shapes the runtime fallback moved to the torch backend).
    """
    with _lock:
        snapshot = dict(_state)
        if _patch is not None:
            snapshot["routed_to_torch"] = [
                {"shape": list(key), "error": error} for key, error in _patch.ops.routed_shapes().items()]
        return snapshot


def _settings():
    from biv100_patch.probe import settings
    return settings


def _decide(backend):
    """The decision ``{"backend", "reason", ...}`` for ``backend``; a failing probe means torch."""
    if backend != "auto":
        return {"backend": backend, "reason": f"requested by apply(backend={backend!r})", "source": "argument"}
    try:
        from biv100_patch import probe
        record = probe.get_decision(progress=False)
        decision = dict(record["decision"])
    except Exception as error:
        _warn_once(f"the probe failed ({type(error).__name__}: {error}); using the torch backend")
        return {"backend": "torch", "source": "fallback",
                "reason": f"the probe failed ({type(error).__name__}: {error}); the PyTorch backend works everywhere"}
    if decision.get("backend") not in ("triton", "torch", "off"):
        return {"backend": "torch", "source": "fallback",
                "reason": f"the record's decision {decision.get('backend')!r} is not triton/torch/off"}
    return decision


def _make_ops(decision, validate_tables):
    """The runtime ops for the decided backend; a Triton backend that cannot be built means torch."""
    from biv100_patch.kernels import get_backend

    from .runtime import PatchedOps
    name = decision["backend"]
    # Variants the probe found wrong here: their calls raise, and PatchedOps routes those shapes to torch.
    options = {"excluded": decision.get("excluded_variants") or ()} if name == "triton" else {}
    try:
        return PatchedOps(get_backend(name, validate_tables=validate_tables, **options), validate_tables)
    except Exception as error:
        if name == "torch":
            raise
        _warn_once(f"the {name} backend could not be loaded ({type(error).__name__}: {error}); using torch")
        decision["backend"] = "torch"
        decision["reason"] = f"the {name} backend could not be loaded ({type(error).__name__}: {error})"
        return PatchedOps(get_backend("torch", validate_tables=validate_tables), validate_tables)


def _patch_module(module, backend):
    """Patch a loaded ``vllm._custom_ops``; sets the state, returns the decision."""
    global _patch, _announced
    settings = _settings()
    match = families.classify(families.installed_version(), module)
    if match.family is None:
        _warn_once(match.reason)
        _set_state("skipped", match.reason, **match.as_dict())
        return {"backend": "off", "reason": match.reason, "source": "vllm"}
    decision = _decide(backend)
    if decision["backend"] == "off":
        _set_state("skipped", f"the decision is off: {decision.get('reason')}", decision=decision, **match.as_dict())
        return decision
    ops = _make_ops(decision, settings.validate_every_call())
    v1, v2 = families.make_replacements(match.family, ops)
    replacements = {"paged_attention_v1": v1, "paged_attention_v2": v2}
    originals = {name: getattr(module, name) for name in families.OP_NAMES}

    registration, dispatcher = None, {"skipped": "vLLM < 0.5 calls pybind functions, not torch.ops._C"}
    if match.family.uses_dispatcher(match.version):
        try:
            from . import dispatcher as dispatcher_module
            registration = dispatcher_module.register(match.family, replacements)
            dispatcher = registration.as_dict()
        except Exception as error:
            dispatcher = {"skipped": f"{type(error).__name__}: {error}"}
            _warn_once(f"torch.ops._C.paged_attention_v1/v2 left as they are ({type(error).__name__}: {error}); "
                       f"{CUSTOM_OPS} is patched")
    for name, function in replacements.items():
        setattr(module, name, function)
    _patch = _Patch(module, originals, replacements, ops, registration)
    reason = decision.get("reason", "")
    _set_state("patched", reason, backend=ops.name, decision=decision, dispatcher=dispatcher, **match.as_dict())
    if not _announced:
        _announced = True
        logger.info("biv100-patch: patched vLLM %s (%s family%s) paged_attention_v1/v2%s with the %s backend: %s",
                    match.raw_version, match.family.name, ", hint_on_error wrappers" if match.wrapped else "",
                    f" and torch.ops._C for {registration.dispatch_key}" if registration else "", ops.name, reason)
    return decision


def _vllm_installed():
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _watch_for_custom_ops():
    """Have the import hook call ``on_custom_ops_loaded`` when ``vllm._custom_ops`` is imported."""
    from . import _startup
    _startup.install()


def apply(backend="auto"):
    """Replace vLLM's paged_attention_v1/v2 with ``backend`` ("auto": the probe's decision).

    Returns the decision dict (``backend``, ``reason``). Idempotent and thread-safe; calling it
    again with another backend re-patches. Before ``vllm._custom_ops`` is imported it only
    arranges for the patch to happen at that import. Without vLLM it says so and does nothing.
    ``backend`` other than auto/triton/torch/off raises ``ValueError``; nothing else raises.
    """
    global _requested
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}; got {backend!r}")
    with _lock:
        try:
            settings = _settings()
            if not settings.patch_enabled():
                reason = "BIV100_PATCH=0: patching is switched off"
                _set_state("skipped", reason)
                return {"backend": "off", "reason": reason, "source": "environment"}
            if backend == "auto" and settings.backend_override() == "off":
                reason = "BIV100_PATCH_BACKEND=off: patching is switched off"
                _set_state("skipped", reason)
                return {"backend": "off", "reason": reason, "source": "environment"}
            module = sys.modules.get(CUSTOM_OPS)
            if module is None:
                if not _vllm_installed():
                    reason = "vLLM is not installed: nothing to patch"
                    _warn_once(reason)
                    _set_state("skipped", reason)
                    return {"backend": "off", "reason": reason, "source": "vllm"}
                _requested = backend
                _watch_for_custom_ops()
                reason = f"waiting for {CUSTOM_OPS} to be imported"
                _set_state("pending", reason, requested=backend)
                return {"backend": backend, "reason": reason, "source": "pending"}
            if _patch is not None:
                if _patch.module is module and (backend == "auto" or backend == _patch.ops.name):
                    return dict(_state["decision"])
                _revert_locked()
            return _patch_module(module, backend)
        except Exception as error:
            reason = f"apply failed ({type(error).__name__}: {error}); vLLM runs unpatched"
            logger.warning("biv100-patch: %s", reason, exc_info=logger.isEnabledFor(logging.DEBUG))
            _set_state("failed", reason)
            return {"backend": "off", "reason": reason, "source": "error"}


def on_custom_ops_loaded(module):
    """The import hook's call, right after ``vllm._custom_ops`` has executed. Never raises.

    Applies the backend a pending ``apply()`` asked for, else "auto" (the probe's decision).
    """
    global _requested
    try:
        with _lock:
            backend, _requested = _requested or "auto", None
            if _state.get("status") == "reverted":  # revert() in this process holds until apply() again
                return {"backend": "off", "reason": _state["reason"], "source": "reverted"}
            if _patch is not None and _patch.module is module:
                return dict(_state.get("decision") or {})
            sys.modules.setdefault(CUSTOM_OPS, module)
            return apply(backend)
    except Exception as error:  # the hook must never break vLLM's import
        _warn_once(f"patching {CUSTOM_OPS} at import failed ({type(error).__name__}: {error}); vLLM runs unpatched")
        return {"backend": "off", "reason": str(error), "source": "error"}


def _revert_locked():
    global _patch, _requested
    _requested = None
    if _patch is None:
        return False
    patch, _patch = _patch, None
    patch.undo()
    return True


def revert():
    """Put back exactly what ``apply()`` replaced (module attributes and dispatcher entries).

    Returns True when something was reverted. Also cancels a pending apply.
    """
    with _lock:
        was_pending = _state.get("status") == "pending"
        reverted = _revert_locked()
        if reverted or was_pending:
            _set_state("reverted", "revert() restored vLLM's own ops" if reverted else "revert() cancelled the "
                       "pending apply")
        return reverted


class _CallableModule(types.ModuleType):
    """Importing ``biv100_patch.patches.apply`` binds the package's name ``apply`` to this module
    (Python's rule for submodules); calling the module still applies, so ``patches.apply()`` works
    whichever of the two the name holds."""

    def __call__(self, backend="auto"):
        return apply(backend)


sys.modules[__name__].__class__ = _CallableModule
