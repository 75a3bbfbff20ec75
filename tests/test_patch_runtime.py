"""The runtime wrapper: a Triton failure for one shape falls back to torch once, correctly, and stays there."""

import importlib
import logging
import math
import threading

import pytest
import torch

from biv100_patch.kernels import PagedAttentionBackend, get_backend
from biv100_patch.patches.runtime import PatchedOps
from tests.fake_vllm import v2_buffers
from tests.reference import reference_attention
from tests.vllm_patch_check import make_case


class CompileError(Exception):
    """Stands in for triton.compiler.errors.CompilationError (any non-ValueError the backend raises)."""


class FlakyTriton:
    """The real Triton backend (interpreter on CPU), failing for one head size as a new shape might."""

    def __init__(self, failing_head_size):
        self.failing_head_size = failing_head_size
        self.real = get_backend("triton")
        self.calls = 0

    def forward(self, call):
        self.calls += 1
        if call.head_size == self.failing_head_size:
            raise CompileError(f"cannot compile the decode kernel for head_size={call.head_size}")
        self.real.forward(call)


@pytest.fixture
def flaky():
    return FlakyTriton(failing_head_size=80)


@pytest.fixture
def ops(flaky):
    events = []
    backend = PagedAttentionBackend("triton", flaky.forward)
    patched = PatchedOps(backend, record_event=events.append)
    patched.events = events
    return patched


def v1_call(ops, case):
    out = torch.full_like(case["query"], math.nan)
    ops.paged_attention_v1(out, case["query"], case["key_cache"], case["value_cache"], case["num_kv_heads"],
                           case["scale"], case["block_tables"], case["seq_lens"], case["block_size"],
                           case["max_seq_len"], None, "auto", 1.0, 1.0)
    return out


def v2_call(ops, case):
    out = torch.full_like(case["query"], math.nan)
    exp_sums, max_logits, tmp_out = (buffer.to(case["query"].device) for buffer in v2_buffers(case))
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, case["query"], case["key_cache"], case["value_cache"],
                           case["num_kv_heads"], case["scale"], case["block_tables"], case["seq_lens"],
                           case["block_size"], case["max_seq_len"], None, "auto", 1.0, 1.0)
    return out


def paged_case(device, *args, **kwargs):
    """``make_case`` on the suite's device: the Triton backend runs natively on a GPU, interpreted on the CPU."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in make_case(torch, *args, **kwargs).items()}


def max_error(out, case):
    on_cpu = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in case.items()}
    return (out.cpu().double() - reference_attention(**on_cpu)["out"]).abs().max().item()


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "biv100_patch" and r.levelno == logging.WARNING]


@pytest.mark.triton_kernels
def test_failure_falls_back_once_and_shape_stays_on_torch(ops, flaky, caplog, monkeypatch, device):
    monkeypatch.delenv("BIV100_PATCH_STRICT", raising=False)
    case = paged_case(device, torch.float32, [40, 530], head_size=80)
    assert max_error(v1_call(ops, case), case) < 1e-4
    assert flaky.calls == 1
    [warning] = warnings_of(caplog)
    assert "the triton backend failed" in warning.getMessage() and "head_size': 80" in warning.getMessage()
    assert "CompileError: cannot compile" in warning.getMessage()
    [event] = ops.events
    assert event["event"] == "runtime_fallback" and event["from"] == "triton" and event["to"] == "torch"
    assert event["shape"]["head_size"] == 80 and event["shape"]["op"] == "v1"

    # Later calls of that shape go straight to torch: no Triton call, no new warning, still correct.
    other = paged_case(device, torch.float32, [3, 17, 100], head_size=80, seed=4)
    assert max_error(v1_call(ops, other), other) < 1e-4
    assert flaky.calls == 1 and len(warnings_of(caplog)) == 1 and len(ops.events) == 1

    # A shape that works keeps using Triton.
    fine = paged_case(device, torch.float32, [40, 530], head_size=64)
    assert max_error(v2_call(ops, fine), fine) < 1e-4
    assert flaky.calls == 2 and len(ops.routed) == 1


def test_strict_mode_reraises(ops, flaky, monkeypatch, device):
    monkeypatch.setenv("BIV100_PATCH_STRICT", "1")
    case = paged_case(device, torch.float32, [40], head_size=80)
    with pytest.raises(CompileError):
        v2_call(ops, case)
    assert ops.routed == {} and ops.events == []


def test_bad_input_is_the_callers_error(ops, flaky, caplog, device):
    case = paged_case(device, torch.float32, [40], head_size=80)
    case["block_tables"] = case["block_tables"].to(torch.int64)
    out = torch.full_like(case["query"], math.nan)
    with pytest.raises(ValueError, match="block_tables: must be int32"):
        ops.paged_attention_v1(out, case["query"], case["key_cache"], case["value_cache"], 2, case["scale"],
                               case["block_tables"], case["seq_lens"], 16, 40, None, "auto", 1.0, 1.0)
    assert flaky.calls == 0 and warnings_of(caplog) == [] and ops.routed == {}
    assert torch.isnan(out).all()


def test_concurrent_failures_warn_once(ops, flaky, caplog, monkeypatch, device):
    monkeypatch.delenv("BIV100_PATCH_STRICT", raising=False)
    case = paged_case(device, torch.float32, [40, 70], head_size=80)
    errors, barrier = [], threading.Barrier(6)

    def worker():
        barrier.wait()
        errors.append(max_error(v1_call(ops, case), case))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 6 and max(errors) < 1e-4
    assert len(warnings_of(caplog)) == 1 and len(ops.events) == 1 and len(ops.routed) == 1


def test_torch_primary_has_no_fallback_path(device):
    ops = PatchedOps(get_backend("torch"))
    case = paged_case(device, torch.float32, [600, 9], head_size=64)
    assert max_error(v2_call(ops, case), case) < 1e-4
    assert ops.routed == {} and ops.name == "torch"


@pytest.mark.triton_kernels
def test_a_variant_the_probe_excluded_runs_on_torch_from_its_first_call(caplog, monkeypatch, device):
    """The probe's ``excluded_variants``: the Triton backend refuses their calls before writing anything, and
    the shape is routed to torch (one warning, one event) with a correct result; other variants stay on Triton."""
    from biv100_patch.kernels import configs

    monkeypatch.delenv("BIV100_PATCH_STRICT", raising=False)
    limits = configs.INTERPRETER_LIMITS
    config = configs.choose_config(limits, 80, 16, torch.float32, "auto", 2)
    excluded = [configs.attention_key(80, 16, torch.float32, "auto", config)]
    events = []
    ops = PatchedOps(get_backend("triton", limits=limits, excluded=excluded), record_event=events.append)
    case = paged_case(device, torch.float32, [40, 530], head_size=80)
    assert max_error(v2_call(ops, case), case) < 1e-4
    [event] = events
    assert event["shape"]["head_size"] == 80 and "VariantExcluded: the probe found" in event["error"]
    assert len(warnings_of(caplog)) == 1 and len(ops.routed_shapes()) == 1

    fine = paged_case(device, torch.float32, [40], head_size=64)  # pads to another binary: still Triton
    assert max_error(v1_call(ops, fine), fine) < 1e-4
    assert len(events) == 1 and len(ops.routed_shapes()) == 1


def test_the_decisions_excluded_variants_reach_the_triton_backend(monkeypatch, device):
    """``apply``'s ops for a triton decision carrying ``excluded_variants``: those calls go to torch."""
    from biv100_patch.kernels import configs
    from biv100_patch.kernels.limits import DeviceLimits

    patch_apply = importlib.import_module("biv100_patch.patches.apply")  # the package's ``apply`` is the function
    monkeypatch.delenv("BIV100_PATCH_STRICT", raising=False)
    limits = configs.INTERPRETER_LIMITS if device.type == "cpu" else DeviceLimits.from_torch_device(device)
    config = configs.choose_config(limits, 64, 16, torch.float32, "auto", 2)
    decision = {"backend": "triton", "excluded_variants": [configs.attention_key(64, 16, "float32", "auto", config)]}
    ops = patch_apply._make_ops(decision, validate_tables=False)
    ops._record_event = lambda event: None
    case = paged_case(device, torch.float32, [40], head_size=64)
    assert max_error(v1_call(ops, case), case) < 1e-4
    assert [shape[2] for shape in ops.routed_shapes()] == [64]
