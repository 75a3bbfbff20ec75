"""Probe-side faults (issue 6): each ends in an exact decision and recorded reason, one log line
or a clear error, no hang and no corrupt file."""

import functools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from biv100_patch import probe
from biv100_patch.kernels import configs
from biv100_patch.probe import decide, ladder, record, versions

from tests.probe_fixtures import fake_gpu, no_accelerator, state  # noqa: F401 (fixtures)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def probe_warnings(caplog):
    return [entry.getMessage() for entry in caplog.records
            if entry.name == "biv100_patch.probe" and entry.levelno == logging.WARNING]


def real_ladder_with(monkeypatch, steps):
    """Run the real ladder (child process included) with fake detection and the given steps."""
    monkeypatch.setattr(decide, "run_ladder", functools.partial(ladder.run_ladder, steps=steps,
                                                                detect="tests.probe_fakes:fake_detect"))


def test_triton_missing(state, monkeypatch, caplog):
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    monkeypatch.setitem(sys.modules, "triton", None)
    found = probe.get_decision(progress=False)
    assert found["decision"] == {"backend": "torch", "source": "probe",
                                 "reason": "Triton is not installed, so the PyTorch backend is used."}
    assert [(entry["name"], entry["status"]) for entry in found["checks"]] == [
        ("triton_import", "failed"), ("trivial_kernel", "skipped"), ("variants_match", "skipped"),
        ("shared_memory", "skipped")]
    assert found["checks"][0]["error"] == "ModuleNotFoundError: triton is not installed"
    assert probe_warnings(caplog) == ["biv100-patch probe: Triton is not installed, so the PyTorch backend is used."]


def test_triton_import_raises(state, tmp_path, monkeypatch, caplog):
    fake = tmp_path / "fake_site" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('libtriton.so: undefined symbol cuModuleLoad')\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    for name in [name for name in sys.modules if name == "triton" or name.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    found = probe.get_decision(progress=False)
    error = "RuntimeError: libtriton.so: undefined symbol cuModuleLoad"
    assert found["checks"][0]["error"] == error
    assert found["decision"]["reason"] == (
        f"Triton step 1 (Triton imports) failed ({error}), so the PyTorch backend is used.")
    assert len(probe_warnings(caplog)) == 1


def test_triton_compile_error_at_probe_time(state, monkeypatch):
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    real_ladder_with(monkeypatch, [("trivial_kernel", "tests.probe_fakes:broken_compile_step"),
                                   ("variants_match", "tests.probe_fakes:passing_step")])
    found = probe.get_decision(progress=False)
    statuses = [entry["status"] for entry in found["checks"]]
    assert statuses == ["passed", "failed", "skipped"]
    error = ("CompilationError", "arange's range must be a power of 2") if configs.triton_3() else \
        ("RuntimeError", "PassManager::run failed")  # Triton 2.x: its TTIR verifier, after the front end
    assert error[0] in found["checks"][1]["error"] and error[1] in found["checks"][1]["error"]
    assert found["checks"][2]["error"] == "skipped: step 'trivial_kernel' failed"
    assert found["decision"]["backend"] == "torch"
    assert found["decision"]["reason"].startswith("Triton step 2 (a trivial kernel compiles and is right) failed "
                                                  f"({error[0]}")
    assert found["storage"]["written"]


def test_a_hanging_kernel_times_out(state, monkeypatch, capsys):
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    real_ladder_with(monkeypatch, [("trivial_kernel", "tests.probe_fakes:passing_step"),
                                   ("variants_match", "tests.probe_fakes:sleeping_step"),
                                   ("shared_memory", "tests.probe_fakes:passing_step")])
    start = time.monotonic()
    found = probe.get_decision(timeout=2, progress=True)
    assert time.monotonic() - start < 15
    assert [entry["status"] for entry in found["checks"]] == ["passed", "passed", "timeout", "skipped"]
    assert found["checks"][2]["error"] == ("TimeoutError: step 'variants_match' reported no progress for 2 s "
                                           "(a hang?); the child was killed")
    assert found["decision"]["reason"] == ("Triton step 3 (paged-attention variants match PyTorch) made no progress "
                                           "for 2 s (a hang?), so the PyTorch backend is used.")
    assert ladder_children() == []  # killed and reaped, not left running
    progress = capsys.readouterr().err
    assert "probe: step 3 paged-attention variants match PyTorch ..." in progress
    assert "probe: ✗ step 3 paged-attention variants match PyTorch timeout" in progress


def test_a_step_that_keeps_progressing_outlives_the_timeout(state, monkeypatch, capsys):
    # 8 variants, 0.5 s each: 4 s in all against a 2 s timeout, never 2 s without progress.
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    monkeypatch.setattr(ladder, "PROGRESS_EVERY_S", 0.0)
    real_ladder_with(monkeypatch, [("variants_match", "tests.probe_fakes:slowly_progressing_step")])
    found = probe.get_decision(timeout=2, progress=True)
    assert [entry["status"] for entry in found["checks"]] == ["passed", "passed"]
    assert found["checks"][1]["seconds"] >= 4 and found["checks"][1]["details"] == {"compared": 8}
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("probe:   step 2: ")]
    assert [line.split()[3] for line in lines] == [f"{done}/8" for done in range(1, 5)] + ["starting"] + [
        f"{done}/8" for done in range(5, 9)]
    assert lines[4] == "probe:   step 2: starting over"
    assert lines[-1].startswith("probe:   step 2: 8/8 kernel variants compared (")


def ladder_children():
    """This process's live children that run the ladder's child code."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"child_main" in command:
            found.append(int(pid))
    return found


def test_timeout_from_the_environment(state, monkeypatch):
    monkeypatch.setenv("BIV100_PATCH_PROBE_TIMEOUT", "1.5")
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    real_ladder_with(monkeypatch, [("variants_match", "tests.probe_fakes:sleeping_step")])
    found = probe.get_decision(progress=False)
    assert found["checks"][1]["status"] == "timeout" and "no progress for 1.5 s" in found["decision"]["reason"]


def test_a_crashing_child_is_a_recorded_failure(state, monkeypatch):
    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
    real_ladder_with(monkeypatch, [("trivial_kernel", "tests.probe_fakes:crashing_step")])
    found = probe.get_decision(progress=False)
    assert found["checks"][1]["status"] == "failed"
    assert found["checks"][1]["error"].startswith(
        "ChildProcessError: the probe's child process ended early (exit code 7)")
    assert found["decision"]["backend"] == "torch"


@pytest.mark.parametrize("content, problem", [
    (b"{\"format\": \"biv100-patch-pro", "is corrupt: Unterminated string"),
    (b"\x80\x81 not json", "is corrupt: 'utf-8' codec"),
    (b"[1, 2, 3]", "is corrupt: not a biv100-patch-probe document"),
    (json.dumps({"format": "biv100-patch-probe", "schema_version": 0}).encode(), "has schema version 0"),
])
@pytest.mark.usefixtures("no_accelerator")
def test_corrupt_record_is_reported_and_replaced(state, caplog, content, problem):
    state.mkdir(mode=0o700)
    path = state / "probe-cpu.json"
    path.write_bytes(content)
    found = probe.get_decision(progress=False)
    assert found["decision"]["backend"] == "torch" and found["storage"]["written"]
    assert len(found["storage"]["problems"]) == 1 and problem in found["storage"]["problems"][0]
    warnings = probe_warnings(caplog)
    assert len(warnings) == 1 and problem in warnings[0] and "replaced by a new probe" in warnings[0]
    assert json.loads(path.read_text())["decision"]["backend"] == "torch"
    assert probe.get_decision(progress=False)["storage"]["problems"] == []


@pytest.mark.usefixtures("no_accelerator")
def test_missing_state_directory_that_cannot_be_created(tmp_path, state, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BIV100_PATCH_HOME", str(blocker / "state"))
    found = probe.get_decision(progress=False)
    assert found["decision"]["backend"] == "torch" and found["storage"]["written"] is False
    assert found["storage"]["problems"] == [f"state directory {blocker / 'state'} cannot be created: Not a directory"]
    assert probe_warnings(caplog) == [f"biv100-patch: state directory {blocker / 'state'} cannot be created: "
                                      "Not a directory; the decision is kept in this process only"]
    assert probe.load_decision() is None
    assert probe.add_runtime_event("runtime_fallback", "kept nowhere") is False


@pytest.mark.usefixtures("no_accelerator")
def test_read_only_state_directory(state, monkeypatch, caplog):
    probe.get_decision(progress=False)  # a record made while the directory was writable

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(record.tempfile, "mkstemp", read_only)
    assert probe.get_decision(progress=False)["storage"]["reused"]  # still readable: reused
    found = probe.get_decision(refresh=True, progress=False)
    assert found["decision"]["backend"] == "torch" and found["storage"]["written"] is False
    problem = f"record {state / 'probe-cpu.json'} cannot be written: Read-only file system"
    assert found["storage"]["problems"] == [problem]
    assert probe_warnings(caplog) == [f"biv100-patch: {problem}; the decision is kept in this process only"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0500 directory")
@pytest.mark.usefixtures("no_accelerator")
def test_read_only_state_directory_by_mode(state):
    state.mkdir(mode=0o500)
    found = probe.get_decision(progress=False)
    assert found["storage"]["written"] is False and "read-only" in found["storage"]["problems"][0]


@pytest.mark.usefixtures("no_accelerator")
def test_state_directory_writable_by_others_is_not_trusted(state, caplog):
    state.mkdir()
    os.chmod(state, 0o777)
    (state / "probe-cpu.json").write_text("{}")  # anyone could have put it there
    found = probe.get_decision(progress=False)
    assert found["storage"]["written"] is False
    assert "is writable by other users (mode 777)" in found["storage"]["problems"][0]
    assert (state / "probe-cpu.json").read_text() == "{}"
    assert probe.load_decision() is None


EIGHT_WORKERS = textwrap.dedent("""
    import json, sys, types
    from biv100_patch import probe
    from biv100_patch.probe import decide
    from tests import probe_fakes
    # No torch import (eight of them would take the test's time): a torch with an accelerator.
    decide._import_torch = lambda: (types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False),
                                                          version=types.SimpleNamespace(cuda="10.2", hip=None)), None)
    decide._accelerator_available = lambda torch: True
    decide.run_ladder = lambda **options: probe_fakes.passing_ladder(counter=sys.argv[1], delay=1.0, **options)
    found = probe.get_decision(progress=False)
    print(json.dumps([found["decision"]["backend"], found["fingerprint_id"], found["created_unix"]]))
""")


def test_eight_processes_probe_once(state, tmp_path):
    counter = tmp_path / "probes"
    environment = dict(os.environ, PYTHONPATH=REPO_ROOT)
    workers = [subprocess.Popen([sys.executable, "-c", EIGHT_WORKERS, str(counter)], cwd=REPO_ROOT,
                                env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(8)]
    answers = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        answers.append(json.loads(out))
    assert len(counter.read_text().splitlines()) == 1
    assert len({json.dumps(answer) for answer in answers}) == 1 and answers[0][0] == "triton"
    stored = json.loads(next(state.glob("probe-gpu-*.json")).read_text())
    assert (stored["fingerprint_id"], stored["created_unix"]) == (answers[0][1], answers[0][2])
    assert [name for name in os.listdir(state) if name.endswith(".tmp")] == []


def test_fingerprint_change_after_an_upgrade_probes_again(fake_gpu, monkeypatch):
    before = probe.get_decision(progress=False)
    real = versions.distribution_version

    def upgraded(names):
        return ("2.2.0+corex.4.0.0", "torch") if names == ("torch",) else real(names)

    monkeypatch.setattr(versions, "distribution_version", upgraded)
    assert probe.load_decision() is None  # the stale record is not used
    after = probe.get_decision(progress=False)
    assert len(fake_gpu.calls) == 2 and after["storage"]["path"] == before["storage"]["path"]
    assert after["replaces"]["fingerprint_id"] == before["fingerprint_id"]
    assert f"host.versions.torch: {before['versions']['torch']['version']!r} -> '2.2.0+corex.4.0.0'" in \
        after["replaces"]["changes"]
    assert probe.load_decision()["fingerprint_id"] == after["fingerprint_id"]


KEEP_WRITING = textwrap.dedent("""
    import sys
    from biv100_patch.probe import record
    store = record.Store(sys.argv[1])
    n = 0
    while True:
        n += 1
        document = {"format": record.FORMAT, "schema_version": record.SCHEMA_VERSION, "generation": n,
                    "fingerprint": {}, "device": {}, "versions": {}, "checks": [],
                    "decision": {"backend": "torch", "reason": "x"}, "padding": "p" * 2_000_000}
        assert store.write("cpu", document) is None
        if n == 1:
            print("ready", flush=True)
""")


def test_sigkill_while_writing_leaves_the_old_or_the_new_record(state):
    state.mkdir(mode=0o700)
    store = record.Store(str(state))
    generations = []
    for attempt in range(4):
        writer = subprocess.Popen([sys.executable, "-c", KEEP_WRITING, str(state)], cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline() == "ready\n"
        time.sleep(random.uniform(0.05, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        found, problem = store.read("cpu")
        assert problem is None and len(found["padding"]) == 2_000_000
        generations.append(found["generation"])
    assert all(generation >= 1 for generation in generations)
    assert store.write("cpu", dict(found, generation=0)) is None
    assert [name for name in os.listdir(state) if name.endswith(".tmp")] == []  # leftovers cleared


def test_a_cut_event_line_is_skipped(fake_gpu):
    probe.get_decision(progress=False)
    assert probe.add_runtime_event("runtime_fallback", "first")
    events_file = next(fake_gpu_state_files("events-"))
    with open(events_file, "ab") as handle:
        handle.write(b'{"kind": "runtime_fallb')  # a writer killed mid-line
    assert probe.add_runtime_event("runtime_fallback", "second")
    assert [event["message"] for event in probe.load_decision()["runtime_events"]] == ["first", "second"]


def fake_gpu_state_files(prefix):
    directory = os.environ["BIV100_PATCH_HOME"]
    return (os.path.join(directory, name) for name in sorted(os.listdir(directory)) if name.startswith(prefix))
