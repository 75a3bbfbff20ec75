"""The decision and its record: CPU decision, overrides, reuse, devices, load_decision's speed,
the real ladder machinery on the CPU, and the ``probe`` command's output and exit codes."""

import json
import os
import re
import stat
import statistics
import time

import pytest
from click.testing import CliRunner

from biv100_patch import probe
from biv100_patch.probe import decide, ladder, record, settings
from biv100_patch.probe_command import probe_command

from tests.conftest import cli_runner
from tests.probe_fakes import BI_V100, passing_ladder
from tests.probe_fixtures import fake_gpu, no_accelerator, state  # noqa: F401 (fixtures)


@pytest.mark.cpu_machine
def test_cpu_decision_is_torch_no_accelerator(state):
    found = probe.get_decision(progress=False)
    assert found["decision"] == {"backend": "torch", "source": "no accelerator", "reason": (
        "No accelerator (torch.cuda.is_available() is false), so the PyTorch backend is used.")}
    assert found["device"]["vendor"] == "cpu" and found["checks"] == []
    assert found["storage"]["written"] is True and found["storage"]["path"] == str(state / "probe-cpu.json")
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state / "probe-cpu.json").st_mode) == 0o600
    on_disk = json.loads((state / "probe-cpu.json").read_text())
    assert on_disk["format"] == "biv100-patch-probe" and on_disk["schema_version"] == 1
    assert {"device", "versions", "checks", "decision", "fingerprint", "created"} <= set(on_disk)


@pytest.mark.usefixtures("no_accelerator")
def test_record_is_reused_while_the_fingerprint_matches(state):
    first = probe.get_decision(progress=False)
    second = probe.get_decision(progress=False)
    assert (second["storage"]["reused"], second["created"]) == (True, first["created"])
    refreshed = probe.get_decision(refresh=True, progress=False)
    assert refreshed["storage"]["reused"] is False and refreshed["created_unix"] >= first["created_unix"]
    assert probe.load_decision()["created"] == refreshed["created"]


@pytest.mark.cpu_machine
def test_triton_forced_on_cpu_is_refused_without_the_interpreter(state, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("BIV100_PATCH_BACKEND", "triton")
    with pytest.raises(probe.OverrideRefused, match="BIV100_PATCH_BACKEND=triton is refused: .*TRITON_INTERPRET=1"):
        probe.get_decision(progress=False)
    probe.get_decision(backend_override="auto", progress=False)  # stores the CPU record
    loaded = probe.load_decision()  # the read path never raises: it says why in the decision
    assert loaded["decision"]["backend"] == "torch" and "refused" in loaded["decision"]["reason"]


def test_triton_forced_on_cpu_is_allowed_with_the_interpreter(state, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    found = probe.get_decision(backend_override="triton", progress=False)
    assert (found["decision"]["backend"], found["decision"]["source"]) == ("triton", "override")
    assert found["decision"]["reason"] == "backend_override=triton is set, so the Triton kernels are used without probing."


def test_passing_ladder_decides_triton(fake_gpu):
    found = probe.get_decision(progress=False)
    assert found["decision"]["backend"] == "triton"
    assert found["decision"]["reason"] == ("Triton passed the probe (12 kernel variants matched the PyTorch backend)"
                                           ", so the Triton kernels are used.")
    assert found["device"]["vendor"] == "iluvatar" and "device name 'Iluvatar BI-V100'" in found["device"]["vendor_signals"]
    assert found["storage"]["key"] == record.device_key(BI_V100) and found["storage"]["written"]
    assert len(fake_gpu.calls) == 1 and fake_gpu.calls[0]["timeout"] == 180.0
    assert probe.get_decision(progress=False)["storage"]["reused"] and len(fake_gpu.calls) == 1


@pytest.mark.parametrize("override, reason", [
    ("torch", "BIV100_PATCH_BACKEND=torch overrides the probe's choice of triton, so the PyTorch backend is used."),
    ("off", "BIV100_PATCH_BACKEND=off overrides the probe's choice of triton, so the patch is turned off."),
])
def test_environment_override_is_recorded_as_one(fake_gpu, monkeypatch, override, reason):
    probe.get_decision(progress=False)
    monkeypatch.setenv("BIV100_PATCH_BACKEND", override)
    for found in (probe.get_decision(progress=False), probe.load_decision()):
        assert found["decision"]["backend"] == override and found["decision"]["reason"] == reason
        assert found["decision"]["source"] == "override" and found["decision"]["probed"]["backend"] == "triton"
    stored = json.loads(open(probe.record_path()).read())
    assert stored["decision"]["backend"] == "triton"  # the override lives in the process, not in the record


def test_override_without_a_record_probes_nothing(fake_gpu, monkeypatch):
    monkeypatch.setenv("BIV100_PATCH_BACKEND", "torch")
    found = probe.get_decision(progress=False)
    assert found["decision"]["backend"] == "torch" and fake_gpu.calls == []
    assert found["storage"]["written"] is False


def test_bad_override_values(state, monkeypatch):
    with pytest.raises(ValueError, match="backend_override: must be one of auto, triton, torch, off"):
        probe.get_decision(backend_override="xformers")
    monkeypatch.setenv("BIV100_PATCH_BACKEND", "fast")
    with pytest.raises(settings.SettingsError, match="BIV100_PATCH_BACKEND='fast' is not allowed"):
        probe.get_decision()
    assert "BIV100_PATCH_BACKEND='fast'" in probe.load_decision()["decision"]["reason"]
    with pytest.raises(ValueError, match="timeout: must be a number of seconds from 1 to 3600"):
        probe.get_decision(backend_override="auto", timeout=0)
    with pytest.raises(ValueError, match="device: must be"):
        probe.get_decision(backend_override="auto", device="tpu:0")


def test_bench_record_is_needed_for_a_bench_request(fake_gpu):
    probe.get_decision(progress=False)
    found = probe.get_decision(bench=True, progress=False)
    assert len(fake_gpu.calls) == 2 and fake_gpu.calls[1]["bench"] is True
    assert "not slower on the decode benchmark (at least 4.00x" in found["decision"]["reason"]
    assert found["bench"]["shapes"][0]["speedup"] == 4.0
    assert probe.get_decision(bench=True, progress=False)["storage"]["reused"]


def test_slower_triton_decides_torch(fake_gpu):
    def slow_ladder(**options):
        outcome = passing_ladder(**options)
        outcome["checks"][-1]["details"]["shapes"][0].update(triton_median_s=0.004, torch_median_s=0.001,
                                                             speedup=0.25)
        return outcome

    fake_gpu.ladder = slow_ladder
    decision = probe.get_decision(bench=True, progress=False)["decision"]
    assert decision["backend"] == "torch"
    assert decision["reason"] == ("Triton passed every check but was slower than PyTorch on decode-v1 "
                                  "(4.000 ms vs 1.000 ms), so the PyTorch backend is used.")


def test_two_devices_keep_two_records(fake_gpu):
    def two_gpus(**options):
        outcome = passing_ladder(**options)
        outcome["device"]["uuid"] = f"GPU-fake-{options['device_index']}"
        if options["device_index"] == 1:
            outcome["checks"][2] = dict(outcome["checks"][2], status="failed", ok=False, error="ValueError: wrong")
        return outcome

    fake_gpu.ladder = two_gpus
    first, second = probe.get_decision(device=0, progress=False), probe.get_decision(device="cuda:1", progress=False)
    assert first["storage"]["path"] != second["storage"]["path"]
    assert (probe.load_decision(0)["decision"]["backend"], probe.load_decision(1)["decision"]["backend"]) == (
        "triton", "torch")
    assert probe.load_decision(1)["decision"]["reason"] == (
        "Triton step 3 (variants_match) failed (ValueError: wrong), so the PyTorch backend is used.")
    assert len(fake_gpu.calls) == 2


def test_load_decision_is_fast_with_torch_imported(fake_gpu):
    import torch  # noqa: F401 (the measured situation: torch already imported)

    probe.get_decision(progress=False)
    probe.load_decision()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        found = probe.load_decision()
        times.append(time.perf_counter() - start)
    assert found["decision"]["backend"] == "triton"
    assert statistics.median(times) < 0.010, times


def test_load_decision_without_a_record(state):
    assert probe.load_decision() is None and probe.record_path() is None


def test_runtime_events_show_in_the_record(fake_gpu):
    probe.get_decision(progress=False)
    assert probe.add_runtime_event("runtime_fallback", "compile error for head 80", details={"head_size": 80})
    assert probe.record_runtime_event({"event": "import_hook_failed", "stage": "patch", "message": "boom"})
    events = probe.load_decision()["runtime_events"]
    assert [(event["kind"], event["message"], event["backend"]) for event in events] == [
        ("runtime_fallback", "compile error for head 80", "triton"), ("import_hook_failed", "boom", "triton")]
    assert events[1]["details"] == {"stage": "patch"} and events[0]["pid"] == os.getpid()


@pytest.mark.cpu_machine
def test_real_ladder_runs_a_real_triton_kernel_on_the_cpu_interpreter(monkeypatch):
    # The machinery end to end: step 1 here, detection and Triton's interpreter in the child.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    outcome = ladder.run_ladder(steps=[ladder.CHILD_STEPS[0]], timeout=120,
                                progress=lambda event, entry: seen.append((event, entry["name"]
                                                                           if "name" in entry else None)))
    assert [entry["status"] for entry in outcome["checks"]] == ["passed", "passed"], outcome
    assert outcome["checks"][1]["details"]["wrong_elements"] == 0
    assert outcome["device"]["name"] == "cpu"
    assert ("start", "trivial_kernel") in seen and ("result", "trivial_kernel") in seen


def run_cli(*arguments):
    return CliRunner().invoke(probe_command, list(arguments))


def test_cli_summary(fake_gpu):
    result = run_cli()
    assert result.exit_code == 0, result.output
    assert "✓ 3 variants_match" in result.output
    assert "decision  triton: Triton passed the probe" in result.output
    assert "capability 7.0 · 16 SMs · warp 64 · 48.0 KB shared/block · 31.7 GB" in result.output


def test_cli_json(fake_gpu):
    result = run_cli("--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert {"device", "versions", "checks", "decision"} <= set(document)
    assert document["decision"]["backend"] == "triton" and document["decision"]["reason"]


@pytest.mark.parametrize("arguments, message", [
    (["--target-capability", "seven"], "--target-capability"),
    (["--timeout", "0"], "--timeout"),
    (["--shared-memory-limit", "49152"], "--shared-memory-limit needs --target-capability"),
    (["--target-capability", "7.0", "--bench"], "--bench probes a device"),
    (["--target-capability", "6.1"], "no default shared-memory limit for capability 6.1"),
])
def test_cli_bad_options_name_the_option(state, arguments, message):
    result = run_cli(*arguments)
    assert result.exit_code == 2 and message in result.output, result.output


def test_cli_bad_environment_exits_2(state, monkeypatch):
    monkeypatch.setenv("BIV100_PATCH_PROBE_TIMEOUT", "forever")
    result = run_cli()
    assert result.exit_code == 2 and "BIV100_PATCH_PROBE_TIMEOUT='forever' is not allowed" in result.output


def test_cli_help_documents_exit_codes():
    result = run_cli("--help")
    assert result.exit_code == 0
    for line in ("0  a decision was made", "1  --target-capability: at least one variant",
                 "2  bad usage", "3  the probe itself could not run"):
        assert line in result.output


def test_cli_aot_report_judges_shared_memory(state, monkeypatch):
    # The report's shape and verdicts with a fake compiler; the real AOT test is in test_probe_aot.py.
    import sys
    import types

    calls = []

    def compile_variants(capability, shared_memory_limit, progress=None):
        calls.append((capability, shared_memory_limit))
        entries = [{"kernel": "v1", "head_size": 128, "block_size": 16, "dtype": "float16", "kv_cache_dtype": "auto",
                    "config": {"num_warps": 4}, "shared_bytes": 16384, "ok": True, "error": None},
                   {"kernel": "v2", "head_size": 256, "block_size": 32, "dtype": "float32", "kv_cache_dtype": "auto",
                    "config": {"num_warps": 8}, "shared_bytes": 65536, "ok": True, "error": None}]
        for done in range(1, len(entries) + 1):
            progress(done, len(entries))
        return entries

    monkeypatch.setitem(sys.modules, "biv100_patch.kernels.variants",
                        types.SimpleNamespace(compile_variants=compile_variants))
    import biv100_patch.kernels
    monkeypatch.setattr(biv100_patch.kernels, "variants", sys.modules["biv100_patch.kernels.variants"], raising=False)
    result = cli_runner().invoke(probe_command, ["--target-capability", "7.0", "--json"])
    assert calls == [((7, 0), 49152)] and result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["target"] == {"capability": "7.0", "shared_memory_limit": 49152}
    assert [(entry["kernel"], entry["ok"]) for entry in document["aot"]] == [("v1", True), ("v2", False)]
    assert document["aot"][1]["error"] == "needs 65536 bytes of shared memory, over 49152"
    assert set(document["aot"][0]) >= {"kernel", "head_size", "block_size", "dtype", "shared_bytes", "ok"}


VARIANT_V1_FP16 = {"kernel": "v1", "head_size": 64, "block_size": 16, "dtype": "float16", "kv_cache_dtype": "auto"}
VARIANT_V2_BF16 = {"kernel": "v2", "head_size": 64, "block_size": 32, "dtype": "bfloat16", "kv_cache_dtype": "auto"}
CPU_CONTEXT = {"device": {"index": None}, "device_index": 0, "results": {}}


@pytest.mark.cpu_machine  # the interpreter is chosen when triton is first imported: on a GPU machine it was not
@pytest.mark.triton_kernels
def test_variants_step_compares_triton_with_torch_on_the_interpreter(monkeypatch):
    # Ladder step 3 with the real kernels (B's Triton backend in the interpreter) on two variants.
    from biv100_patch.probe import steps

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(steps, "_kernel_variants", lambda context: [VARIANT_V1_FP16, VARIANT_V2_BF16])
    details = steps.variants_match(dict(CPU_CONTEXT))
    assert (details["compared"], details["failed"]) == (2, 0)
    assert [entry["ok"] for entry in details["variants"]] == [True, True]
    assert details["variants"][0]["max_abs_diff"] < 2e-3 and details["variants"][1]["max_abs_diff"] < 3e-2


def test_variants_step_names_the_variant_that_differs(monkeypatch):
    from biv100_patch.kernels import get_backend
    from biv100_patch.probe import steps

    class OffByATenth:
        def paged_attention_v1(self, out, *arguments, **options):
            get_backend("torch").paged_attention_v1(out, *arguments, **options)
            out.add_(0.125)

    monkeypatch.setattr(steps, "_kernel_variants", lambda context: [VARIANT_V1_FP16])
    monkeypatch.setattr(steps, "get_backend", lambda name, **options: OffByATenth() if name == "triton"
                        else get_backend(name))
    with pytest.raises(steps.StepFailure) as failure:
        steps.variants_match(dict(CPU_CONTEXT))
    # 0.125 added in fp16: the difference seen is 0.125 within fp16 rounding of outputs up to ~4.
    assert re.fullmatch(r"1 of 1 variants failed; first: v1 head 64 block 16 float16 auto: differs from "
                        r"the PyTorch backend by 0\.12\d? \(atol 0\.001\)", str(failure.value)), str(failure.value)
    assert failure.value.details["failed"] == 1


def test_variants_step_excludes_the_variants_that_differ_when_others_match(monkeypatch):
    """Some variants wrong: the step passes, listing their kernel keys under ``excluded`` (the patch routes
    those shapes to torch); the decision stays triton, says so and carries the keys."""
    from biv100_patch.kernels import get_backend
    from biv100_patch.probe import steps

    class WrongOnV1:
        def paged_attention_v1(self, out, *arguments, **options):
            get_backend("torch").paged_attention_v1(out, *arguments, **options)
            out.add_(0.125)

        def paged_attention_v2(self, *arguments, **options):
            get_backend("torch").paged_attention_v2(*arguments, **options)

    wrong, right = ["attention", 64, True, 16, "float16", "auto", 16, 16, 1, 1, True, True], ["attention", 64]
    monkeypatch.setattr(steps, "_kernel_variants", lambda context: [dict(VARIANT_V1_FP16, variant_key=wrong),
                                                                    dict(VARIANT_V2_BF16, variant_key=right)])
    monkeypatch.setattr(steps, "get_backend", lambda name, **options: WrongOnV1() if name == "triton"
                        else get_backend(name))
    details = steps.variants_match(dict(CPU_CONTEXT))
    assert (details["compared"], details["failed"], details["excluded"]) == (2, 1, [wrong])

    checks = [{"step": 3, "name": "variants_match", "title": "t", "status": "passed", "error": None,
               "details": details}]
    decision = decide.decide_from_checks(checks, 180, bench=False)
    assert decision["backend"] == "triton" and decision["excluded_variants"] == [wrong]
    assert "1 of 2 kernel variants matched the PyTorch backend; the shapes of the 1 that did not use it" \
        in decision["reason"]


def test_the_summary_names_the_excluded_variants():
    from biv100_patch.probe_command import summary

    key = ["attention", 256, False, 16, "float32", "auto", 16, 16, 1, 1, True, True]
    text = summary({"decision": {"backend": "triton", "reason": "r", "excluded_variants": [key]}})
    assert ("excluded  head sizes padded to 256, block 16, float32, cache auto (16 query rows, 16-token steps, "
            "1 warps, 1 stages, tl.dot, prefetch): such calls use the PyTorch backend") in text


def test_a_step_3_worker_that_dies_is_pinned_on_its_variant():
    """A compiler crash takes its worker process and the whole pool with it: each variant then runs in a
    process of its own, and only the one that dies fails."""
    from concurrent.futures.process import BrokenProcessPool

    from biv100_patch.probe import steps
    from tests import probe_fakes

    variants = [dict(VARIANT_V1_FP16, variant_key=["a"]), dict(VARIANT_V2_BF16, variant_key=["b"], crash=True),
                dict(VARIANT_V1_FP16, head_size=128, variant_key=["c"])]
    with pytest.raises(BrokenProcessPool):
        steps._compare_in_pool(0, variants, 2, compare=probe_fakes.compare_or_die)
    counted = []
    entries, compiled = steps._compare_isolated(0, variants, 2, compare=probe_fakes.compare_or_die,
                                                progress=lambda done, total: counted.append((done, total)))
    assert [(entry["variant_key"], entry["ok"]) for entry in entries] == [(["a"], True), (["b"], False),
                                                                         (["c"], True)]
    assert entries[1]["error"] == steps.PROCESS_DIED
    assert compiled == [["_attention_kernel", 1024], ["_attention_kernel", 2048], ["_reduce_kernel", 512]]
    assert counted == [(1, 3), (2, 3), (3, 3)]


def test_step_3_says_when_a_dead_worker_starts_the_isolated_round(monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    from biv100_patch.probe import steps

    def broken_pool(*arguments, **options):
        raise BrokenProcessPool("a worker died")

    monkeypatch.setattr(steps, "_kernel_variants", lambda context: [VARIANT_V1_FP16, VARIANT_V2_BF16])
    monkeypatch.setattr(steps, "_compare_in_pool", broken_pool)
    monkeypatch.setattr(steps, "_compare_isolated", lambda index, to_run, workers, progress: (
        [dict(variant, ok=True) for variant in to_run], [["_attention_kernel", 1024]]))
    monkeypatch.setattr(steps.os, "cpu_count", lambda: 2)
    told = []
    details = steps.variants_match({"device": {"index": 0}, "device_index": 0, "results": {},
                                    "progress": lambda done, total, note=None: told.append((done, total, note))})
    assert told == [(0, 2, steps.WORKER_DIED)] and (details["compared"], details["failed"]) == (2, 0)


def test_step_3_pool_hands_out_one_variant_at_a_time_in_order():
    from biv100_patch.probe import steps
    from tests import probe_fakes

    variants = [dict(VARIANT_V1_FP16, head_size=size, variant_key=[size]) for size in (64, 80, 96, 112, 128)]
    counted = []
    entries, compiled = steps._compare_in_pool(0, variants, 2, compare=probe_fakes.compare_or_die,
                                               progress=lambda done, total: counted.append((done, total)))
    assert [entry["head_size"] for entry in entries] == [64, 80, 96, 112, 128] and all(e["ok"] for e in entries)
    assert compiled == sorted([["_attention_kernel", 16 * size] for size in (64, 80, 96, 112, 128)]
                              + [["_reduce_kernel", 512]])
    assert counted == [(done, 5) for done in range(1, 6)]


def test_non_finite_measurements_are_kept_as_json(fake_gpu):
    def nan_ladder(**options):
        outcome = passing_ladder(**options)
        outcome["checks"][2]["details"]["max_abs_diff"] = float("nan")
        return outcome

    fake_gpu.ladder = nan_ladder
    found = probe.get_decision(progress=False)
    assert found["storage"]["written"]
    assert json.loads(open(found["storage"]["path"]).read())["checks"][2]["details"]["max_abs_diff"] == "nan"


def test_compiled_kernels_are_read_from_both_triton_cache_layouts():
    import types

    from biv100_patch.probe import steps

    new = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=40960))
    old = types.SimpleNamespace(shared=16384)
    triton3 = types.SimpleNamespace(device_caches={0: ({"key": new}, "target", "backend", "binder")})
    triton2 = types.SimpleNamespace(cache={0: {"key": old}})
    assert [steps._shared_bytes(kernel) for kernel in steps._compiled_kernels(triton3)] == [40960]
    assert [steps._shared_bytes(kernel) for kernel in steps._compiled_kernels(triton2)] == [16384]


def test_step_3_covers_every_default_format_binary_and_fp8_samples(monkeypatch):
    from biv100_patch.kernels import limits, variants
    from biv100_patch.probe import steps

    bi_v100 = limits.DeviceLimits(shared_memory_per_block=49152, multiprocessor_count=16, warp_size=64,
                                  capability=(7, 0))
    monkeypatch.setattr(steps, "device_limits", lambda context: bi_v100)
    chosen = steps._kernel_variants({"device": {"index": 0}})
    keys = {v.compile_key() for v in variants.variant_list(bi_v100)
            if v.kernel == "attention" and v.kv_cache_dtype == "auto"}
    binary_calls = [e for e in chosen if e["kv_cache_dtype"] == "auto" and e["kernel"] == "v2" and "num_seqs" not in e]
    covered = {(e["dtype"], e["block_size"]) for e in binary_calls}
    assert len(binary_calls) == len(keys)
    assert covered == {(dtype, block) for dtype in ("float32", "float16", "bfloat16") for block in (8, 16, 32)}
    assert {e["kv_cache_dtype"] for e in chosen} == {"auto", "fp8_e4m3", "fp8_e5m2"}
    assert {e["dtype"] for e in chosen if e["kernel"] == "v1"} == {"float32", "float16", "bfloat16"}


def test_step_3_v1_cases_split_so_both_split_reduces_run(monkeypatch):
    # Step 3's v1 calls must reach both of v1's split paths on a BI-V100's figures and on the interpreter's: the
    # splits combined in the attention launch, and (default cache format) more splits than that takes, which
    # _reduce_kernel combines. A 53-token case once ran as one split, so the reduce went unprobed.
    import torch

    from biv100_patch.kernels import configs, contract, limits, paged_attention_triton
    from biv100_patch.probe import steps

    bi_v100 = limits.DeviceLimits(shared_memory_per_block=49152, multiprocessor_count=16, warp_size=64,
                                  capability=(7, 0))
    for device_limits in (bi_v100, configs.INTERPRETER_LIMITS):
        monkeypatch.setattr(steps, "device_limits", lambda context: device_limits)
        v1_cases = [e for e in steps._kernel_variants({"device": {"index": 0}}) if e["kernel"] == "v1"]
        paths = set()
        for entry in v1_cases:
            case = steps.variant_case(entry)
            call = contract.check_call(torch.empty_like(case["query"]), **case)
            plan = paged_attention_triton._plan(call, device_limits)  # the backend's own plan
            splits = plan.splits_for(call)[0]
            assert splits > 1, entry
            paths.add((entry["dtype"], entry["kv_cache_dtype"], "fused" if splits <= plan.fused_splits else "reduce"))
        dtypes = ("float32", "float16", "bfloat16")
        assert paths == {(dtype, fmt, "fused") for dtype in dtypes for fmt in ("auto", "fp8_e4m3", "fp8_e5m2")} | {
            (dtype, "auto", "reduce") for dtype in dtypes}


def test_step_3_runs_a_v2_batch_whose_partitions_stay_whole(monkeypatch):
    # Small v2 grids cut vLLM's partitions into sub-splits (another kernel combines them); a large batch keeps
    # them whole and goes through _reduce_kernel on vLLM's tmp_out. Step 3 reaches both, per query dtype.
    import torch

    from biv100_patch.kernels import configs, contract, limits, paged_attention_triton
    from biv100_patch.probe import steps

    bi_v100 = limits.DeviceLimits(shared_memory_per_block=49152, multiprocessor_count=16, warp_size=64,
                                  capability=(7, 0))
    h200 = limits.DeviceLimits(shared_memory_per_block=232448, multiprocessor_count=132, warp_size=32,
                               capability=(9, 0))
    for device_limits in (bi_v100, configs.INTERPRETER_LIMITS, h200):
        monkeypatch.setattr(steps, "device_limits", lambda context: device_limits)
        chosen = steps._kernel_variants({"device": {"index": 0}})
        batches = [e for e in chosen if e["kernel"] == "v2" and "num_seqs" in e]
        assert sorted(e["dtype"] for e in batches) == ["bfloat16", "float16", "float32"]
        for batch in batches:
            binary = next(e for e in chosen if e["kernel"] == "v2" and "num_seqs" not in e
                          and e["variant_key"] == batch["variant_key"])
            subs = []
            for entry in (binary, batch):
                case = steps.variant_case(entry)
                out = torch.empty_like(case["query"])
                partitions = -(-case["max_seq_len"] // contract.PARTITION_SIZE)
                call = contract.check_call(out, **case, exp_sums=torch.empty(*out.shape[:2], partitions),
                                           max_logits=torch.empty(*out.shape[:2], partitions),
                                           tmp_out=torch.empty(*out.shape[:2], partitions, out.shape[2],
                                                               dtype=out.dtype))
                subs.append(paged_attention_triton._plan(call, device_limits).splits_for(call)[2])
            assert subs[0] > 1 and subs[1] == 1, (device_limits, batch, subs)


@pytest.mark.triton_kernels
def test_step_3_reduce_kernel_cases_match_the_pytorch_backend(monkeypatch, device):
    # The long v1 call and the v2 batch, run as step 3 runs them (the interpreter on a CPU): both backends agree.
    from biv100_patch.kernels import configs, get_backend, limits
    from biv100_patch.probe import steps

    device_limits = (limits.DeviceLimits.from_torch_device(device) if device.type == "cuda"
                     else configs.INTERPRETER_LIMITS)
    monkeypatch.setattr(steps, "device_limits", lambda context: device_limits)
    cases = [e for e in steps._kernel_variants({"device": {"index": 0}})
             if e["dtype"] == "float16" and ("num_seqs" in e or "seq_lens" in e)]
    assert sorted(e["kernel"] for e in cases) == ["v1", "v2"]
    triton_backend, torch_backend = get_backend("triton", limits=device_limits), get_backend("torch")
    for entry in cases:
        found = steps._compare_variant(triton_backend, torch_backend, device, entry)
        assert found["ok"] and "error" not in found, found
        assert found["max_abs_diff"] > 0, found  # a real comparison ran


@pytest.mark.parametrize("largest, fits", [(49152, True), (49153, False)])
def test_step_4_judges_the_binaries_step_3_compiled_in_its_workers(monkeypatch, largest, fits):
    from biv100_patch.kernels import limits
    from biv100_patch.probe import steps

    bi_v100 = limits.DeviceLimits(shared_memory_per_block=49152, multiprocessor_count=16, warp_size=64,
                                  capability=(7, 0))
    monkeypatch.setattr(steps, "device_limits", lambda context: bi_v100)
    context = {"device": {"index": 0},
               "results": {"variants_match": {"compiled": [["_attention", 8192], ["_attention", largest],
                                                           ["_reduce", 0]]}}}
    if fits:
        assert steps.shared_memory(context) == {"limit": 49152, "binaries": 3, "measured": 3, "largest": 49152}
    else:
        with pytest.raises(steps.StepFailure, match="1 of 3 compiled kernels need more than 49152 bytes"):
            steps.shared_memory(context)


def test_step_4_fails_when_step_3_compiled_nothing(monkeypatch):
    from biv100_patch.kernels import limits
    from biv100_patch.probe import steps

    monkeypatch.setattr(steps, "device_limits", lambda context: limits.DeviceLimits(
        shared_memory_per_block=49152, multiprocessor_count=16, warp_size=64, capability=(7, 0)))
    with pytest.raises(steps.StepFailure, match="no compiled kernel was found"):
        steps.shared_memory({"device": {"index": 0}, "results": {}})
