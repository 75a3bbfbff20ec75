"""The decision: which backend the patch uses on a device, why, and the record that keeps it.

``get_decision`` reuses a record whose fingerprint matches (host: versions, driver, interpreter
switch, visible devices; device: uuid, name, capability) and otherwise probes under the host's
lock, so that processes starting together probe once. ``load_decision`` only reads: it never
imports torch, starts a process or initialises a device, for the import hook and the patcher.
"""

import logging
import os
import sys
import time

import filelock

from . import detect, record, settings, versions
from .record import log_once

# With --bench, Triton counts as "not slower" within this share of PyTorch's median (timer noise).
BENCH_NOISE = 0.05
# Waiting for another process's probe: a probe that keeps progressing may run past its (stall) timeout,
# so several timeouts' worth, plus time to write the record; then this process probes on its own.
LOCK_WAIT_TIMEOUTS = 5
LOCK_MARGIN_S = 60.0
UNRECORDED_EVENTS_KEY = "unrecorded"


class ProbeError(RuntimeError):
    """The probe cannot give a decision as asked."""


class OverrideRefused(ProbeError, ValueError):
    """A forced backend that cannot work here (Triton on a machine without an accelerator)."""


def host_fingerprint(version_report=None):
    """What must stay the same for a record to be reused, readable without importing torch."""
    version_report = version_report or versions.collect()
    return {
        "schema_version": record.SCHEMA_VERSION,
        "versions": versions.fingerprint_versions(version_report),
        "driver": detect.driver_fingerprint(),
        "triton_interpret": settings.triton_interpret(),
        "visible_devices": settings.visible_devices(),
    }


def device_fingerprint(device):
    return {key: device.get(key) for key in ("index", "name", "capability", "uuid")}


def device_index(device):
    """``device`` (None, an int, ``"cuda:1"`` or a torch.device) as an index; None means the current one."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError(f"device: must be None, an index >= 0, 'cuda[:N]' or a torch.device; got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device: must be an index >= 0; got {device}")
        return device
    text = str(device)
    kind, _, number = text.partition(":")
    if kind not in ("cuda", "hip") or (number and not number.isdigit()):
        raise ValueError(f"device: must be None, an index >= 0, 'cuda[:N]' or a torch.device; got {device!r}")
    return int(number) if number else None


def _identity(torch, index):
    """Name, capability and uuid of the device when CUDA is already initialised here (else None)."""
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    except Exception:
        return None
    uuid = getattr(props, "uuid", None)
    return {"name": props.name, "capability": [props.major, props.minor], "uuid": str(uuid) if uuid else None}


def _matches(stored_device, index, identity):
    if identity is not None and stored_device.get("index") is not None:
        if stored_device.get("uuid") and identity["uuid"]:
            return stored_device["uuid"] == identity["uuid"]
        return (stored_device.get("name"), stored_device.get("capability")) == (identity["name"],
                                                                               identity["capability"])
    if index is not None:  # a device asked for by index: only its own record
        return stored_device.get("index") == index
    return stored_device.get("index") in (0, None)


def lookup(store, host, index, identity, need_bench=False):
    """``(record, problems)``: the newest stored record for this host and device, and unusable ones seen.

    A device record (an index) wins over the CPU record: without an initialised device, the index
    and the visible-devices variables (in ``host``) are what identifies the device.
    """
    problems = []
    candidates = []
    for found, problem in store.scan():
        if problem:
            problems.append(problem)
            continue
        fingerprint = found.get("fingerprint") or {}
        if fingerprint.get("host") != host or not _matches(fingerprint.get("device") or {}, index, identity):
            continue
        if need_bench and not found.get("bench_run"):
            continue
        candidates.append(found)
    candidates.sort(key=lambda found: (found["device"].get("index") is not None, found.get("created_unix", 0)),
                    reverse=True)
    return (candidates[0] if candidates else None), problems


def decide_from_checks(checks, timeout, bench):
    """``{"backend", "reason", "source"}`` from the ladder's entries."""
    failed = next((entry for entry in checks if entry["status"] != "passed"), None)
    if failed is not None:
        if failed["name"] == "triton_import" and "not installed" in (failed["error"] or ""):
            reason = "Triton is not installed, so the PyTorch backend is used."
        elif failed["status"] == "timeout":
            reason = (f"Triton step {failed['step']} ({failed['title']}) made no progress for {timeout:g} s "
                      "(a hang?), so the PyTorch backend is used.")
        else:
            reason = (f"Triton step {failed['step']} ({failed['title']}) failed ({record.summary_line(failed['error'])}), "
                      "so the PyTorch backend is used.")
        return {"backend": "torch", "reason": reason, "source": "probe"}
    variants = next((entry["details"] for entry in checks if entry["name"] == "variants_match"), None) or {}
    compared, excluded = variants.get("compared"), variants.get("excluded") or []
    if excluded:
        what = (f"{compared - variants.get('failed', 0)} of {compared} kernel variants matched the PyTorch backend; "
                f"the shapes of the {len(excluded)} that did not use it instead")
    else:
        what = f"{compared} kernel variants matched the PyTorch backend" if compared else "every check passed"
    if bench:
        shapes = next((entry["details"].get("shapes") for entry in checks if entry["name"] == "bench"), None) or []
        slower = [shape for shape in shapes
                  if shape["triton_median_s"] > shape["torch_median_s"] * (1 + BENCH_NOISE)]
        if slower:
            shape = slower[0]
            return {"backend": "torch", "source": "probe", "reason": (
                f"Triton passed every check but was slower than PyTorch on {shape['name']} "
                f"({shape['triton_median_s'] * 1e3:.3f} ms vs {shape['torch_median_s'] * 1e3:.3f} ms), "
                "so the PyTorch backend is used.")}
        if shapes:
            speedup = min(shape["speedup"] for shape in shapes)
            what += f" and Triton was not slower on the decode benchmark (at least {speedup:.2f}x PyTorch's speed)"
    decision = {"backend": "triton", "reason": f"Triton passed the probe ({what}), so the Triton kernels are used.",
                "source": "probe"}
    if excluded:
        decision["excluded_variants"] = excluded
    return decision


def _base_record(host, version_report, device, checks, decision, bench, started):
    created, unix = record.now()
    fingerprint = {"host": host, "device": device_fingerprint(device)}
    bench_entry = next((entry for entry in checks if entry["name"] == "bench"), None)
    return {
        "format": record.FORMAT,
        "schema_version": record.SCHEMA_VERSION,
        "created": created,
        "created_unix": unix,
        "probe_seconds": round(time.perf_counter() - started, 3),
        "fingerprint": fingerprint,
        "fingerprint_id": record.fingerprint_id(fingerprint),
        "device": device,
        "versions": version_report,
        "checks": checks,
        "bench_run": bool(bench),
        "bench": bench_entry["details"] if bench_entry and bench_entry["ok"] else None,
        "decision": decision,
    }


def _cpu_device(torch):
    vendor, signals = detect.classify(None, torch_module=torch, accelerator=False)
    return {"index": None, "name": "cpu", "capability": None, "uuid": None, "accelerator": False,
            "vendor": vendor, "vendor_signals": signals, "driver": detect.driver_details(vendor)}


def _probe(host, version_report, index, bench, timeout, progress, torch):
    started = time.perf_counter()
    if not _accelerator_available(torch):
        decision = {"backend": "torch", "source": "no accelerator",
                    "reason": "No accelerator (torch.cuda.is_available() is false), so the PyTorch backend is used."}
        return _base_record(host, version_report, _cpu_device(torch), [], decision, False, started)
    from . import ladder

    outcome = run_ladder(device_index=index or 0, bench=bench, timeout=timeout,
                         progress=ladder.stderr_progress if progress is True else progress or None)
    device = outcome["device"] or {"index": index or 0, "name": None, "capability": None, "uuid": None}
    device = dict(device, index=device.get("index", index or 0))
    vendor, signals = detect.classify(device.get("name"), torch_module=torch, accelerator=True)
    device.update(accelerator=True, vendor=vendor, vendor_signals=signals, driver=detect.driver_details(vendor))
    if outcome["device_error"]:
        device["error"] = outcome["device_error"]
    decision = decide_from_checks(outcome["checks"], timeout, bench)
    if decision["backend"] != "triton":
        log_once(logging.WARNING, f"biv100-patch probe: {decision['reason']}")
    return _base_record(host, version_report, device, outcome["checks"], decision, bench, started)


def run_ladder(**options):
    """The ladder (``ladder.run_ladder``); a seam that tests replace with a fake."""
    from . import ladder

    return ladder.run_ladder(**options)


def _accelerator_available(torch):
    return bool(torch.cuda.is_available())


def _import_torch():
    try:
        import torch
    except Exception as error:  # torch missing or broken: nothing to patch
        return None, f"{type(error).__name__}: {error}"
    return torch, None


def _override(backend_override):
    if backend_override is None:
        return settings.backend_override(), "BIV100_PATCH_BACKEND"
    if backend_override not in settings.BACKEND_CHOICES:
        raise ValueError(f"backend_override: must be one of {', '.join(settings.BACKEND_CHOICES)} or None; "
                         f"got {backend_override!r}")
    return backend_override, "backend_override"


def apply_override(found, override, origin):
    """The record with an override's decision in place of the probe's (the probe's kept as ``probed``)."""
    if override == "auto":
        return found
    accelerator = found["device"].get("accelerator")
    if override == "triton" and accelerator is False and not settings.triton_interpret():
        raise OverrideRefused(f"{origin}=triton is refused: this machine has no accelerator; "
                              "set TRITON_INTERPRET=1 to run Triton's interpreter on the CPU (tests only)")
    probed = found.get("decision")
    what = {"off": "the patch is turned off", "torch": "the PyTorch backend is used",
            "triton": "the Triton kernels are used"}[override]
    if probed and probed.get("backend"):
        reason = f"{origin}={override} overrides the probe's choice of {probed['backend']}, so {what}."
    else:
        reason = f"{origin}={override} is set, so {what} without probing."
    found["decision"] = {"backend": override, "reason": reason, "source": "override", "override": override,
                         "origin": origin, "probed": probed}
    return found


def _finish(found, store, *, reused, written, problems, path=None):
    # ``found`` is this call's own: freshly parsed or just probed, never shared.
    key = record.device_key(found.get("device"))
    found["storage"] = {"state_dir": store.directory, "key": key, "path": path or store.record_path(key),
                        "reused": reused, "written": written, "problems": problems}
    found["runtime_events"] = store.events(key, found.get("fingerprint_id"))
    return found


def _report(problems, what):
    for problem in problems:
        log_once(logging.WARNING, f"biv100-patch: {problem}; {what}")


def get_decision(refresh=False, backend_override=None, timeout=None, bench=False, device=None, progress=True):
    """The backend decision for ``device`` as its record (a dict), probing when no record fits.

    ``record["decision"]["backend"]`` is triton, torch or off and ``["reason"]`` one sentence.
    ``refresh`` probes even if a record fits; ``bench`` adds the timing step (a record without it
    is not reused); ``timeout``: the longest the probe's child may report no progress before it is
    killed as hung (default ``BIV100_PATCH_PROBE_TIMEOUT`` or 180 s); ``progress`` True prints each
    step and step 3's progress on stderr, a callable gets ``(event, entry)``.
    ``backend_override`` (default: ``BIV100_PATCH_BACKEND``) is applied on top and recorded as such.
    Raises ``settings.SettingsError`` / ValueError for bad values and ``OverrideRefused`` for a
    forced Triton without an accelerator; a state directory it cannot use only means the
    decision is not kept (``record["storage"]``).
    """
    override, origin = _override(backend_override)
    if timeout is None:
        timeout = settings.probe_timeout()
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 3600:
        raise ValueError(f"timeout: must be a number of seconds from 1 to 3600; got {timeout!r}")
    index = device_index(device)
    store = record.Store()
    version_report = versions.collect()
    host = host_fingerprint(version_report)
    torch = sys.modules.get("torch")
    problems = []
    if not refresh:
        found, problems = lookup(store, host, index, _identity(torch, index), need_bench=bench)
        if found is not None:
            return apply_override(_finish(found, store, reused=True, written=False, problems=problems),
                                  override, origin)
    torch, torch_error = _import_torch()
    if torch is None:
        return _without_torch(store, host, version_report, torch_error)
    if override != "auto" and not refresh:
        return apply_override(_finish(_unprobed(host, version_report, index, torch), store, reused=False,
                                      written=False, problems=problems), override, origin)
    _report(problems, "it will be replaced by a new probe")
    unusable = store.prepare()
    if unusable:
        log_once(logging.WARNING, f"biv100-patch: {unusable}; the decision is kept in this process only")
        found = _probe(host, version_report, index, bench, timeout, progress, torch)
        return apply_override(_finish(found, store, reused=False, written=False, problems=problems + [unusable]),
                              override, origin)
    lock_wait = LOCK_WAIT_TIMEOUTS * timeout + LOCK_MARGIN_S
    try:
        with store.lock(lock_wait):
            if not refresh:
                found, _ = lookup(store, host, index, _identity(torch, index), need_bench=bench)
                if found is not None:  # another process probed while we waited
                    return apply_override(_finish(found, store, reused=True, written=False, problems=problems),
                                          override, origin)
            found = _probe(host, version_report, index, bench, timeout, progress, torch)
            previous, _ = store.read(record.device_key(found["device"]))
            if previous and previous.get("fingerprint_id") != found["fingerprint_id"]:
                found["replaces"] = {"fingerprint_id": previous.get("fingerprint_id"),
                                     "changes": fingerprint_changes(previous.get("fingerprint", {}),
                                                                    found["fingerprint"])}
            write_problem = store.write(record.device_key(found["device"]), found)
    except filelock.Timeout:
        write_problem = f"the probe lock in {store.directory} was held for over {lock_wait:g} s"
        found = _probe(host, version_report, index, bench, timeout, progress, torch)
    if write_problem:
        log_once(logging.WARNING, f"biv100-patch: {write_problem}; the decision is kept in this process only")
        problems = problems + [write_problem]
    return apply_override(_finish(found, store, reused=False, written=not write_problem, problems=problems),
                          override, origin)


def _unprobed(host, version_report, index, torch):
    """The record of an override that needs no probe: what is known without running one."""
    started = time.perf_counter()
    if not _accelerator_available(torch):
        device = _cpu_device(torch)
    else:
        vendor, signals = detect.classify(None, torch_module=torch, accelerator=True)
        device = {"index": index or 0, "name": None, "capability": None, "uuid": None, "accelerator": True,
                  "vendor": vendor, "vendor_signals": signals}
    return _base_record(host, version_report, device, [], None, False, started)


def _without_torch(store, host, version_report, torch_error):
    """Without torch there is nothing to patch, whatever an override asks for."""
    device = {"index": None, "name": None, "capability": None, "uuid": None, "accelerator": False,
              "vendor": "unknown", "vendor_signals": [], "error": torch_error}
    decision = {"backend": "off", "source": "no torch",
                "reason": f"torch cannot be imported ({record.summary_line(torch_error)}), so there is nothing to patch."}
    found = _base_record(host, version_report, device, [], decision, False, time.perf_counter())
    return _finish(found, store, reused=False, written=False, problems=[])


def fingerprint_changes(old, new, prefix=""):
    """``["host.versions.torch: '2.1.0' -> '2.2.0'", ...]``: what differs between two fingerprints."""
    changes = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            changes.extend(fingerprint_changes(before, after, f"{prefix}{key}."))
        elif before != after:
            changes.append(f"{prefix}{key}: {before!r} -> {after!r}")
    return changes


def load_decision(device=None):
    """The stored decision for ``device`` (the record, override applied), or None when there is none.

    Read-only and cheap (a few ms): never imports torch, starts a process or initialises a device;
    when CUDA is already initialised the device's uuid picks the record, else its index and the
    visible-devices variables do. Never raises: a bad setting or a refused override comes back as
    a ``torch`` decision saying why.
    """
    try:
        override, origin = _override(None)
        index = device_index(device)
        store = record.Store()
        host = host_fingerprint()
        found, problems = lookup(store, host, index, _identity(sys.modules.get("torch"), index))
    except (settings.SettingsError, ValueError) as error:
        return _refusal(str(error))
    if found is None:
        return None
    found = _finish(found, store, reused=True, written=False, problems=problems)
    try:
        return apply_override(found, override, origin)
    except OverrideRefused as error:
        found["decision"] = {"backend": "torch", "reason": f"{error}.", "source": "override refused",
                             "probed": found["decision"]}
        return found


def _refusal(message):
    log_once(logging.WARNING, f"biv100-patch: {message}; the PyTorch backend is used")
    return {"format": record.FORMAT, "schema_version": record.SCHEMA_VERSION, "device": {}, "versions": {},
            "checks": [], "fingerprint": None, "storage": None, "runtime_events": [],
            "decision": {"backend": "torch", "source": "bad setting",
                         "reason": f"{message}, so the PyTorch backend is used."}}


def record_path(device=None):
    """Path of the record ``load_decision`` would use for ``device`` (None when there is none)."""
    found = load_decision(device)
    return (found.get("storage") or {}).get("path") if found else None


def add_runtime_event(kind, message=None, *, device=None, details=None):
    """Add one runtime event (e.g. the patcher's fallback) to the device's record; True when kept.

    ``kind`` is a short name, or a whole event dict (its ``event``/``kind`` key names it and the
    rest becomes ``details``). Never raises and never waits on a lock: the line is appended to
    ``events-<key>.jsonl`` beside the record and shows under the record's ``runtime_events``.
    """
    try:
        if isinstance(kind, dict):
            details = dict(kind, **(details or {}))
            kind = details.pop("event", None) or details.pop("kind", None) or "event"
            message = message or details.pop("message", None)
        found = load_decision(device)
        storage = (found or {}).get("storage") or {}
        store = record.Store(storage.get("state_dir"))
        created, unix = record.now()
        event = {"time": created, "unix": unix, "pid": os.getpid(), "kind": str(kind),
                 "message": None if message is None else str(message), "details": details or {},
                 "fingerprint_id": (found or {}).get("fingerprint_id"),
                 "backend": ((found or {}).get("decision") or {}).get("backend")}
        problem = store.append_event(storage.get("key") or UNRECORDED_EVENTS_KEY, event)
    except Exception as error:  # the caller is a serving process: report, never raise
        problem = f"runtime event not kept: {type(error).__name__}: {error}"
    if problem:
        log_once(logging.WARNING, f"biv100-patch: {problem}")
        return False
    return True


# The name the patcher uses.
record_runtime_event = add_runtime_event
