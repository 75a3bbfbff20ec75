"""The environment variables biv100-patch reads, each validated in one place.

Every reader raises ``SettingsError`` naming the variable and the values it allows; callers
that must never fail (the import hook, the patch) catch it, log once and fall back.
"""

import os

import platformdirs

APP_NAME = "biv100-patch"

BACKEND_CHOICES = ("auto", "triton", "torch", "off")
_SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}


class SettingsError(ValueError):
    """An environment variable holds a value biv100-patch does not accept."""


def _switch(name, default):
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in _SWITCH_VALUES:
        raise SettingsError(f"{name}={os.environ[name]!r} is not allowed; use 1 or 0 (also true/false, yes/no, on/off)")
    return _SWITCH_VALUES[raw]


def patch_enabled():
    """``BIV100_PATCH=0`` leaves every process alone (default: on)."""
    return _switch("BIV100_PATCH", True)


def strict():
    """``BIV100_PATCH_STRICT=1`` re-raises kernel failures instead of falling back (for tests)."""
    return _switch("BIV100_PATCH_STRICT", False)


def validate_every_call():
    """``BIV100_PATCH_VALIDATE=1`` checks block tables and sequence lengths on every call."""
    return _switch("BIV100_PATCH_VALIDATE", False)


def backend_override():
    """``BIV100_PATCH_BACKEND``: one of auto, triton, torch, off (default auto)."""
    raw = os.environ.get("BIV100_PATCH_BACKEND", "").strip().lower()
    if not raw:
        return "auto"
    if raw not in BACKEND_CHOICES:
        raise SettingsError(
            f"BIV100_PATCH_BACKEND={os.environ['BIV100_PATCH_BACKEND']!r} is not allowed; "
            f"use one of {', '.join(BACKEND_CHOICES)}")
    return raw


def probe_timeout(default=180.0):
    """``BIV100_PATCH_PROBE_TIMEOUT``: seconds the probe's child may go without progress (1 to 3600)."""
    raw = os.environ.get("BIV100_PATCH_PROBE_TIMEOUT", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= 3600:
        raise SettingsError(f"BIV100_PATCH_PROBE_TIMEOUT={raw!r} is not allowed; use a number of seconds from 1 to 3600")
    return value


def triton_interpret():
    """``TRITON_INTERPRET`` (Triton's own switch): true when Triton runs kernels in its CPU interpreter.

    Not ours to reject, so anything but 1/true/yes/on reads as off, as Triton reads it.
    """
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


# Which devices a process sees; part of the record's fingerprint, never interpreted.
VISIBLE_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ILUVATAR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
# Set by the CoreX SDK's environment scripts: a vendor signal, reported as found.
COREX_VARIABLES = ("COREX_HOME", "COREX_PATH", "COREX_ROOT")


def visible_devices():
    """The device-selection variables that are set, as ``{name: value}``."""
    return {name: os.environ[name] for name in VISIBLE_DEVICE_VARIABLES if name in os.environ}


def corex_environment():
    """The CoreX SDK variables that are set and non-empty, as ``{name: value}``."""
    return {name: os.environ[name] for name in COREX_VARIABLES if os.environ.get(name, "").strip()}


def state_dir():
    """Where the decision record lives: ``BIV100_PATCH_HOME`` (an absolute path) or the user cache dir."""
    raw = os.environ.get("BIV100_PATCH_HOME", "").strip()
    if not raw:
        return platformdirs.user_cache_dir(APP_NAME)
    if not os.path.isabs(raw) or "\0" in raw:
        raise SettingsError(f"BIV100_PATCH_HOME={raw!r} is not allowed; use an absolute directory path")
    return raw
