"""The Triton viability ladder: five steps, each recorded with ok, seconds and the error text.

1. Triton imports (here, in the caller's process);
2. a trivial kernel compiles and gives the right answer on the device;
3. every paged-attention variant the patch would use matches the PyTorch backend;
4. their shared memory fits the device's limit;
5. (``bench``) median times of both backends on a representative decode shape.

Steps 2-5, and reading the device's properties, run in a child process (``subprocess``, its own
session) under a stall timeout: some Triton kernels hang a BI-V100, and a hang must become a recorded
failure, never a stuck probe. The child reports each step's start and result, and each kernel variant
step 3 has compared, as JSON lines on a private pipe; when it reports nothing for ``timeout`` seconds
the running step is recorded as timed out and the child killed. A slow compiler that keeps finishing
variants is not a hang: it is shown progressing, not cut off.
Steps are named ``module:function`` so tests can run fakes in the same child machinery.
"""

import importlib
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .record import safe_text, summary_line

TITLES = {
    "triton_import": "Triton imports",
    "trivial_kernel": "a trivial kernel compiles and is right",
    "variants_match": "paged-attention variants match PyTorch",
    "shared_memory": "shared memory fits the device",
    "bench": "Triton is not slower than PyTorch",
}
UNITS = {"variants_match": "kernel variants compared"}  # what a step's progress counts
DETECT = "biv100_patch.probe.steps:detect_device"
CHILD_STEPS = (
    ("trivial_kernel", "biv100_patch.probe.steps:trivial_kernel"),
    ("variants_match", "biv100_patch.probe.steps:variants_match"),
    ("shared_memory", "biv100_patch.probe.steps:shared_memory"),
)
BENCH_STEP = ("bench", "biv100_patch.probe.steps:bench")
MESSAGE_PREFIX = "@biv100-probe "
KILL_WAIT_S = 5.0
STDERR_TAIL = 1500
_CHILD_CODE = "from biv100_patch.probe.ladder import child_main; child_main()"


def check(number, name, status, seconds=0.0, error=None, details=None):
    """One ladder entry; ``status`` is passed, failed, skipped or timeout."""
    return {"step": number, "name": name, "title": TITLES.get(name, name), "status": status,
            "ok": status == "passed", "seconds": round(float(seconds), 3),
            "error": safe_text(error) if error else None, "details": details or {}}


def _error_text(error):
    return f"{type(error).__name__}: {error}"


def import_triton_step(import_module=importlib.import_module):
    """Step 1, in this process: ``(check, triton_version)``."""
    start = time.perf_counter()
    try:
        spec_found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        spec_found = True  # a half-imported module: let the import itself say what is wrong
    if not spec_found:
        return check(1, "triton_import", "failed", time.perf_counter() - start,
                     "ModuleNotFoundError: triton is not installed"), None
    try:
        module = import_module("triton")
    except Exception as error:  # any import failure is a finding, not a crash
        return check(1, "triton_import", "failed", time.perf_counter() - start, _error_text(error)), None
    version = getattr(module, "__version__", None)
    return check(1, "triton_import", "passed", time.perf_counter() - start,
                 details={"version": version}), version


PROGRESS_EVERY_S = 5.0  # within a step, at most one progress line per this many seconds (and the last)
_last_progress_line = [0.0]


def stderr_progress(event, entry):
    """Default progress display: one line per step start and result, and a step's progress, on stderr."""
    if event == "start":
        _last_progress_line[0] = time.monotonic()
        print(f"probe: step {entry['step']} {entry['title']} ...", file=sys.stderr, flush=True)
    elif event == "progress":
        now = time.monotonic()
        if entry.get("note"):
            print(f"probe:   step {entry['step']}: {entry['note']}", file=sys.stderr, flush=True)
        elif entry["done"] == entry["total"] or now - _last_progress_line[0] >= PROGRESS_EVERY_S:
            _last_progress_line[0] = now
            print(f"probe:   step {entry['step']}: {entry['done']}/{entry['total']} {entry['unit']} "
                  f"({entry['seconds']:.0f} s)", file=sys.stderr, flush=True)
    elif event == "result":
        mark = {"passed": "✓", "skipped": "–"}.get(entry["status"], "✗")
        tail = f": {summary_line(entry['error'])}" if entry.get("error") else ""
        print(f"probe: {mark} step {entry['step']} {entry['title']} {entry['status']} "
              f"({entry['seconds']:.2f} s){tail}", file=sys.stderr, flush=True)
    elif event == "device":
        print(f"probe: device {entry.get('name')}", file=sys.stderr, flush=True)


def run_ladder(*, device_index=0, bench=False, timeout=180.0, progress=None, steps=None, detect=DETECT,
               import_module=importlib.import_module):
    """Run the ladder; returns ``{"device", "device_error", "checks", "triton_version"}``.

    ``steps`` (``[(name, "module:function"), ...]``) replaces steps 2-5 (tests pass fakes);
    ``progress(event, entry)`` is told of each start and result, and (event "progress", entry with
    ``done``, ``total``, ``unit``, ``seconds`` and any ``note``) of the work a step reports done. ``timeout``: the
    longest the child may go without reporting anything.
    """
    notify = progress or (lambda event, entry: None)
    child_steps = list(steps) if steps is not None else list(CHILD_STEPS) + ([BENCH_STEP] if bench else [])
    notify("start", check(1, "triton_import", "running"))
    first, triton_version = import_triton_step(import_module)
    notify("result", first)
    result = {"device": None, "device_error": None, "checks": [first], "triton_version": triton_version}
    if not first["ok"]:
        for number, (name, _) in enumerate(child_steps, start=2):
            result["checks"].append(check(number, name, "skipped", error="skipped: Triton does not import"))
        return result
    child = _run_child(device_index, detect, child_steps, timeout, notify)
    result.update(child)
    result["checks"] = [first] + child["checks"]
    return result


def _run_child(device_index, detect, child_steps, timeout, notify):
    spec = {"sys_path": sys.path, "device_index": device_index, "detect": detect,
            "steps": [list(step) for step in child_steps]}
    numbered = {name: number for number, (name, _) in enumerate(child_steps, start=2)}
    done_checks, device, device_error, running, finished = {}, None, None, None, False
    with tempfile.TemporaryFile() as child_stderr:
        process = subprocess.Popen([sys.executable, "-c", _CHILD_CODE], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=child_stderr, start_new_session=True)
        messages = queue.Queue()
        threading.Thread(target=_read_messages, args=(process.stdout, messages), daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
        except OSError:
            pass  # the child died at once; its exit status says why below
        started_at = time.perf_counter()
        timed_out = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                message = messages.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if message is None:
                break
            deadline = time.monotonic() + timeout  # it reported: not hung
            kind = message.get("event")
            if kind == "device":
                device = message["device"]
                notify("device", device)
            elif kind == "device_error":
                device_error = message["error"]
            elif kind == "start":
                running = message["step"]
                started_at = time.perf_counter()
                notify("start", check(numbered.get(running, 0), running, "running"))
            elif kind == "progress" and message.get("step") == running:
                entry = check(numbered.get(running, 0), running, "running", time.perf_counter() - started_at)
                entry.update(done=message.get("done"), total=message.get("total"), unit=message.get("unit"),
                             note=message.get("note"))
                notify("progress", entry)
            elif kind == "result":
                entry = check(numbered.get(message["step"], 0), message["step"], message["status"],
                              message.get("seconds", 0.0), message.get("error"), message.get("details"))
                done_checks[message["step"]] = entry
                running = None
                notify("result", entry)
            elif kind == "done":
                finished = True
        if timed_out:
            _kill(process)
            what = f"step {running!r}" if running else "the child process"
            failure = f"TimeoutError: {what} reported no progress for {timeout:g} s (a hang?); the child was killed"
        else:
            try:
                process.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                _kill(process)
            failure = None
            if not finished:
                failure = (f"ChildProcessError: the probe's child process ended early ({_exit_text(process)})"
                           f": {_tail(child_stderr)}")
    checks = []
    for number, (name, _) in enumerate(child_steps, start=2):
        if name in done_checks:
            checks.append(done_checks[name])
        elif name == running and failure:
            status = "timeout" if timed_out else "failed"
            entry = check(number, name, status, time.perf_counter() - started_at, failure)
            notify("result", entry)
            checks.append(entry)
        else:
            reason = "skipped: the probe stopped before this step" if failure else "skipped"
            checks.append(check(number, name, "skipped", error=reason))
    if device is None and device_error is None and failure:
        device_error = failure
    return {"device": device, "device_error": device_error, "checks": checks}


def _read_messages(stream, messages):
    prefix = MESSAGE_PREFIX.encode()
    for line in stream:
        if line.startswith(prefix):
            try:
                messages.put(json.loads(line[len(prefix):].decode("utf-8")))
            except ValueError:
                pass
    messages.put(None)


def _kill(process):
    # The child leads its own session: kill its whole group (compilers it started included).
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass  # stuck in the driver (uninterruptible): leave it rather than hang with it


def _exit_text(process):
    code = process.poll()
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tail(handle):
    handle.seek(0, os.SEEK_END)
    size = handle.tell()
    handle.seek(max(0, size - STDERR_TAIL))
    text = handle.read().decode("utf-8", errors="replace").strip()
    return text or "no output on stderr"


def resolve(target):
    """The function a ``module:function`` name points at."""
    module_name, _, function_name = target.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


def child_main():
    """The child's side: read the spec on stdin, run detection and the steps, report JSON lines."""
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # whatever the kernels print goes to stderr, not into the reports

    def send(**message):
        channel.write(MESSAGE_PREFIX + json.dumps(message, default=str) + "\n")
        channel.flush()

    spec = json.loads(sys.stdin.read())
    sys.path[:] = spec["sys_path"]
    context = {"device_index": spec["device_index"], "device": None, "results": {}}
    try:
        context["device"] = resolve(spec["detect"])(context)
        send(event="device", device=context["device"])
    except Exception as error:
        send(event="device_error", error=safe_text(_error_text(error)))
        for name, _ in spec["steps"]:
            send(event="result", step=name, status="skipped", error="skipped: the device could not be read")
        send(event="done")
        return
    failed = None
    for name, target in spec["steps"]:
        if failed:
            send(event="result", step=name, status="skipped", error=f"skipped: step {failed!r} failed")
            continue
        send(event="start", step=name)
        context["progress"] = lambda done, total, note=None, step=name: send(
            event="progress", step=step, done=done, total=total, unit=UNITS.get(step, "done"), note=note)
        start = time.perf_counter()
        try:
            details = resolve(target)(context) or {}
            status, error = "passed", None
        except Exception as exc:
            details, status, error = getattr(exc, "details", {}), "failed", safe_text(_error_text(exc))
            failed = name
        context["results"][name] = details
        send(event="result", step=name, status=status, seconds=time.perf_counter() - start, error=error,
             details=details)
    send(event="done")
