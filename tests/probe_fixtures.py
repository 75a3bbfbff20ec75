"""Fixtures shared by the probe's test modules (imported there by name)."""

import pytest

from tests.probe_fakes import passing_ladder

PROBE_VARIABLES = ("BIV100_PATCH_BACKEND", "BIV100_PATCH_PROBE_TIMEOUT", "COREX_HOME", "COREX_PATH", "COREX_ROOT",
                   "CUDA_VISIBLE_DEVICES", "ILUVATAR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


@pytest.fixture
def state(tmp_path, monkeypatch):
    """A fresh state directory (not yet created) and no probe settings in the environment. Records are
    matched as in a process that has not touched CUDA: on a GPU machine the suite's kernel tests initialise
    the real device, whose identity would otherwise make a faked device's record not fit."""
    from biv100_patch.probe import decide, record

    for name in PROBE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    directory = tmp_path / "state"
    monkeypatch.setenv("BIV100_PATCH_HOME", str(directory))
    monkeypatch.setattr(record, "_logged", set())
    monkeypatch.setattr(decide, "_identity", lambda torch, index: None)
    return directory


@pytest.fixture
def no_accelerator(state, monkeypatch):
    """``state``, and the probe sees no accelerator on any machine (the CPU record, decision torch)."""
    from biv100_patch.probe import decide

    monkeypatch.setattr(decide, "_accelerator_available", lambda torch: False)
    return state


class FakeGpu:
    """Makes the probe see an accelerator and run ``ladder`` (default: passing) instead of the real one."""

    def __init__(self, monkeypatch):
        from biv100_patch.probe import decide

        self.calls = []
        self.ladder = passing_ladder
        monkeypatch.setattr(decide, "_accelerator_available", lambda torch: True)
        monkeypatch.setattr(decide, "run_ladder", self._run)

    def _run(self, **options):
        self.calls.append(options)
        return self.ladder(**options)


@pytest.fixture
def fake_gpu(state, monkeypatch):
    return FakeGpu(monkeypatch)
