"""Versions of the stack, read from distribution metadata without importing anything.

CoreX builds carry their vendor tag only in the metadata (``torch`` reports ``2.1.0`` while pip
knows ``2.1.0+corex.3.2.3``), so the metadata is the source; ``packaging.version`` splits it.
"""

import importlib.metadata as metadata
import platform
import re

from packaging.version import InvalidVersion, Version

# Report name -> distribution names to try, first found wins (torch's own Triton builds are
# published as pytorch-triton / pytorch-triton-rocm).
DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm"),
    "vllm": ("vllm",),
    "biv100-patch": ("biv100-patch",),
}


def describe(text, distribution=None):
    """``{"version", "public", "local", "corex", "distribution"}`` for one version string (None: missing)."""
    if text is None:
        return {"version": None, "public": None, "local": None, "corex": False, "distribution": None,
                "error": "not installed"}
    entry = {"version": text, "public": None, "local": None, "corex": False, "distribution": distribution}
    try:
        parsed = Version(text)
    except InvalidVersion:
        entry["error"] = "not a PEP 440 version"
        entry["corex"] = "corex" in text.lower()
        return entry
    entry["public"] = parsed.public
    entry["local"] = parsed.local
    entry["corex"] = bool(parsed.local) and "corex" in parsed.local.lower()
    return entry


_VERSION_HEADER = re.compile(r"^Version:[ \t]*(\S+)[ \t]*$", re.MULTILINE)


def distribution_version(names):
    """``(version, distribution)`` of the first installed distribution in ``names``, else ``(None, None)``.

    The ``Version:`` header is read directly: parsing torch's whole METADATA as an e-mail
    message costs milliseconds, and ``load_decision`` has a budget of ten.
    """
    for name in names:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        text = distribution.read_text("METADATA") or distribution.read_text("PKG-INFO") or ""
        header = text.split("\n\n", 1)[0]
        match = _VERSION_HEADER.search(header)
        return (match.group(1) if match else distribution.version), name
    return None, None


def collect():
    """Every component's ``describe`` entry, keyed python, torch, triton, vllm, biv100-patch."""
    report = {"python": describe(platform.python_version(), "python")}
    for key, names in DISTRIBUTIONS.items():
        report[key] = describe(*distribution_version(names))
    return report


def fingerprint_versions(report):
    """The raw version strings only: what the record's fingerprint compares."""
    return {key: entry["version"] for key, entry in report.items()}


def at_least(entry, minimum):
    """Whether a ``describe`` entry's public version is at least ``minimum`` (False when missing)."""
    if not entry or not entry.get("public"):
        return False
    return Version(entry["public"]) >= Version(minimum)
