"""Detection: each vendor signal faked on its own, device properties from fake torch/Triton
surfaces, versions from metadata strings, and the settings' validation."""

import os
import types

import pytest

from biv100_patch.probe import detect, settings, versions

from tests.probe_fakes import BI_V100


def no_tool(name):
    return None


def signals(device_name=None, torch_module=None, torch_version="2.13.0+cpu", environ=None, which=no_tool,
            corex_root=None):
    return detect.iluvatar_signals(device_name, torch_module=torch_module, torch_version=torch_version,
                                   environ={} if environ is None else environ, which=which,
                                   corex_root=corex_root)


def fake_torch(cuda=None, hip=None, corex=False):
    module = types.SimpleNamespace(version=types.SimpleNamespace(cuda=cuda, hip=hip))
    if corex:
        module.corex = object()
    return module


def test_no_signal_on_a_plain_machine():
    assert signals() == []


def test_corex_local_version_of_the_torch_distribution():
    assert signals(torch_version="2.1.0+corex.3.2.3") == ["torch distribution version 2.1.0+corex.3.2.3"]


def test_torch_corex_attribute():
    assert signals(torch_module=fake_torch(cuda="10.2", corex=True)) == ["torch has a corex attribute"]


@pytest.mark.parametrize("variable", ["COREX_HOME", "COREX_PATH"])
def test_corex_environment_variables(variable):
    assert signals(environ={variable: "/opt/corex"}) == [f"{variable}=/opt/corex"]


def test_corex_environment_read_through_settings(monkeypatch):
    for name in settings.COREX_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COREX_HOME", "/usr/local/corex-3.2.3")
    assert "COREX_HOME=/usr/local/corex-3.2.3" in detect.iluvatar_signals(
        torch_version="2.1.0", which=no_tool, corex_root=None)


@pytest.mark.parametrize("name", ["Iluvatar BI-V100", "BI-V150", "iluvatar mr-v100"])
def test_device_name(name):
    assert signals(device_name=name) == [f"device name {name!r}"]


def test_nvidia_name_is_no_iluvatar_signal():
    assert signals(device_name="NVIDIA H200") == []


def test_ixsmi_on_path(tmp_path, monkeypatch):
    tool = tmp_path / "ixsmi"
    tool.write_text("#!/bin/sh\necho 'Driver Version: 3.2.3'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    import shutil
    assert signals(which=shutil.which) == [f"ixsmi on PATH ({tool})"]
    assert detect.driver_details("iluvatar", which=shutil.which)["ixsmi_driver"] == "3.2.3"


def test_corex_install_directory(tmp_path):
    real = tmp_path / "corex-3.2.3"
    real.mkdir()
    link = tmp_path / "corex"
    link.symlink_to(real)
    assert signals(corex_root=str(link)) == [f"{link} exists"]
    assert detect.corex_version(environ={}, corex_root=str(link)) == "3.2.3"


def test_classify_iluvatar_wins_over_cuda():
    # CoreX's torch says cuda '10.2'; the corex signal decides.
    vendor, found = detect.classify("Iluvatar BI-V100", torch_module=fake_torch(cuda="10.2"), accelerator=True,
                                    torch_version="2.1.0+corex.3.2.3", environ={}, which=no_tool, corex_root=None)
    assert vendor == "iluvatar"
    assert found == ["torch distribution version 2.1.0+corex.3.2.3", "device name 'Iluvatar BI-V100'"]


@pytest.mark.parametrize("torch_module, accelerator, vendor, signal", [
    (fake_torch(cuda="12.4"), True, "nvidia", "torch.version.cuda=12.4"),
    (fake_torch(hip="6.2.4"), True, "amd", "torch.version.hip=6.2.4"),
    (fake_torch(cuda="12.4"), False, "cpu", "torch.cuda.is_available() is false"),
])
def test_classify_other_vendors(torch_module, accelerator, vendor, signal):
    assert detect.classify("Some GPU", torch_module=torch_module, accelerator=accelerator, torch_version="2.5.0",
                           environ={}, which=no_tool, corex_root=None) == (vendor, [signal])


def fake_props(name, major, minor, **extra):
    return types.SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=extra.pop("sms", 16),
                                 total_memory=extra.pop("memory", 34057748480), **extra)


def torch_with(props):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_properties=lambda index: props))


def test_bi_v100_properties_take_warp_and_shared_memory_from_triton():
    props = fake_props("Iluvatar BI-V100", 7, 0, shared_memory_per_block=49152)
    info = detect.device_properties(torch_with(props), 0, {"warpSize": 64, "max_shared_mem": 65536})
    assert (info["capability"], info["multiprocessor_count"], info["warp_size"],
            info["shared_memory_per_block"]) == ([7, 0], 16, 64, 65536)
    assert info["sources"] == {"shared_memory_per_block": "triton driver max_shared_mem",
                               "warp_size": "triton driver warpSize"}


def test_bi_v100_without_driver_query_uses_the_vendor_warp_size():
    props = fake_props("Iluvatar BI-V100", 7, 0, shared_memory_per_block=49152)
    info = detect.device_properties(torch_with(props), 0, None)
    assert (info["warp_size"], info["shared_memory_per_block"], info["uuid"]) == (64, 49152, None)
    assert info["sources"]["warp_size"] == "default for the vendor (no driver property)"


def test_nvidia_properties_use_the_opt_in_shared_memory_and_uuid():
    props = fake_props("NVIDIA H200", 9, 0, sms=132, shared_memory_per_block=49152,
                       shared_memory_per_block_optin=232448, warp_size=32, uuid="GPU-1234")
    info = detect.device_properties(torch_with(props), 0, None)
    assert (info["shared_memory_per_block"], info["warp_size"], info["uuid"]) == (232448, 32, "GPU-1234")


def test_nvidia_driver_version_from_proc(tmp_path):
    driver_file = tmp_path / "version"
    driver_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n")
    assert detect.nvidia_driver_version(str(driver_file)) == "570.124.06"
    assert detect.nvidia_driver_version(str(tmp_path / "missing")) is None


def test_versions_split_corex_local_versions():
    entry = versions.describe("2.1.0+corex.3.2.3", "torch")
    assert (entry["public"], entry["local"], entry["corex"]) == ("2.1.0", "corex.3.2.3", True)
    assert versions.at_least(entry, "2.1") and not versions.at_least(entry, "2.2")
    assert versions.describe(None)["error"] == "not installed"
    assert versions.describe("0.6.3.post1+corex.3.2.3")["public"] == "0.6.3.post1"
    assert versions.describe("not-a-version")["error"] == "not a PEP 440 version"


def test_versions_of_this_environment():
    report = versions.collect()
    assert list(report) == ["python", "torch", "triton", "vllm", "biv100-patch"]
    import torch
    assert report["torch"]["public"] == torch.__version__.split("+")[0]
    assert report["biv100-patch"]["version"] == "0.1.0"
    assert report["vllm"]["version"] is None or report["vllm"]["public"]


@pytest.mark.parametrize("variable, value, reader", [
    ("BIV100_PATCH_PROBE_TIMEOUT", "soon", settings.probe_timeout),
    ("BIV100_PATCH_PROBE_TIMEOUT", "0", settings.probe_timeout),
    ("BIV100_PATCH_PROBE_TIMEOUT", "nan", settings.probe_timeout),
    ("BIV100_PATCH_BACKEND", "cuda", settings.backend_override),
    ("BIV100_PATCH_HOME", "relative/dir", settings.state_dir),
])
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value, reader):
    monkeypatch.setenv(variable, value)
    with pytest.raises(settings.SettingsError, match=variable):
        reader()


def test_good_environment_values(monkeypatch, tmp_path):
    monkeypatch.setenv("BIV100_PATCH_PROBE_TIMEOUT", "30")
    monkeypatch.setenv("BIV100_PATCH_BACKEND", " Torch ")
    monkeypatch.setenv("BIV100_PATCH_HOME", str(tmp_path))
    assert (settings.probe_timeout(), settings.backend_override(), settings.state_dir()) == (30.0, "torch",
                                                                                              str(tmp_path))


def test_fake_device_is_a_bi_v100():
    # The fakes the other probe tests use look like the notes' BI-V100.
    assert (BI_V100["capability"], BI_V100["multiprocessor_count"], BI_V100["warp_size"]) == ([7, 0], 16, 64)
