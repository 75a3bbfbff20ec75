"""Who made the device and what it measures: vendor signals, device properties, driver versions.

Vendor signals are cheap (metadata, environment, PATH, one directory); device properties need an
initialised device and are read in the probe's child process, so that probing never initialises
CUDA in the caller's process (vLLM forks workers after import). Nothing here is assumed from the
device name: every figure comes from torch, Triton's driver or the driver itself.
"""

import os
import re
import shutil
import subprocess

from . import settings, versions

COREX_ROOT = "/usr/local/corex"
NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"
# Name fragments that identify an Iluvatar part (FlagSparse and vllm-plugin-FL use the same).
ILUVATAR_NAME_MARKS = ("iluvatar", "bi-v", "corex")
# FlagTree's Iluvatar backend: warps are 64 threads wide when no driver property says otherwise.
ILUVATAR_WARP_SIZE = 64
DEFAULT_WARP_SIZE = 32
TOOL_TIMEOUT_S = 10


def iluvatar_signals(device_name=None, *, torch_module=None, torch_version=None, environ=None,
                     which=shutil.which, corex_root=COREX_ROOT):
    """Each Iluvatar signal that holds, as a short sentence; empty when none does.

    ``torch_version`` is the torch distribution's version (metadata, not ``torch.__version__``,
    which is bare on CoreX); ``torch_module`` is only looked at when already imported.
    """
    signals = []
    if torch_version is None:
        torch_version, _ = versions.distribution_version(("torch",))
    if torch_version and "+corex" in torch_version.lower():
        signals.append(f"torch distribution version {torch_version}")
    if torch_module is not None and hasattr(torch_module, "corex"):
        signals.append("torch has a corex attribute")
    corex_env = settings.corex_environment() if environ is None else {
        name: environ[name] for name in settings.COREX_VARIABLES if environ.get(name, "").strip()}
    for name, value in corex_env.items():
        signals.append(f"{name}={value}")
    if device_name and any(mark in device_name.lower() for mark in ILUVATAR_NAME_MARKS):
        signals.append(f"device name {device_name!r}")
    ixsmi = which("ixsmi")
    if ixsmi:
        signals.append(f"ixsmi on PATH ({ixsmi})")
    if corex_root and os.path.isdir(corex_root):
        signals.append(f"{corex_root} exists")
    return signals


def classify(device_name=None, *, torch_module=None, accelerator=False, **signal_sources):
    """``(vendor, signals)``: iluvatar, nvidia, amd or cpu, with the signals that decided it."""
    signals = iluvatar_signals(device_name, torch_module=torch_module, **signal_sources)
    if signals:
        return "iluvatar", signals
    version = getattr(torch_module, "version", None)
    hip = getattr(version, "hip", None)
    cuda = getattr(version, "cuda", None)
    if hip:
        return "amd", [f"torch.version.hip={hip}"]
    if cuda and accelerator:
        return "nvidia", [f"torch.version.cuda={cuda}"]
    if not accelerator:
        return "cpu", ["torch.cuda.is_available() is false" if torch_module is not None else "torch not imported"]
    return "unknown", ["an accelerator without a CUDA or HIP torch build"]


def triton_device_properties(index):
    """Triton's driver view of device ``index`` (warp size, opt-in shared memory), or None.

    ``driver.active`` exists from Triton 2.2 on; older builds keep ``driver.utils``.
    """
    try:
        from triton.runtime import driver
        active = getattr(driver, "active", driver)
        return dict(active.utils.get_device_properties(index))
    except Exception:  # an old or vendor Triton without the query: torch's figures stand
        return None


def device_properties(torch_module, index, triton_properties=None):
    """Name, capability and limits of device ``index``, each limit with where it was read.

    Shared memory is the opt-in maximum per block (what a kernel may request), and the warp
    size comes from Triton's driver where it reports one: torch has no warp size on CoreX.
    """
    props = torch_module.cuda.get_device_properties(index)
    name = props.name
    uuid = getattr(props, "uuid", None)
    info = {
        "index": index,
        "name": name,
        "capability": [props.major, props.minor],
        "multiprocessor_count": props.multi_processor_count,
        "total_memory": props.total_memory,
        "uuid": str(uuid) if uuid else None,
        "sources": {},
    }
    shared = getattr(props, "shared_memory_per_block_optin", None)
    info["sources"]["shared_memory_per_block"] = "torch shared_memory_per_block_optin"
    if not shared:
        shared = getattr(props, "shared_memory_per_block", None)
        info["sources"]["shared_memory_per_block"] = "torch shared_memory_per_block"
    warp = getattr(props, "warp_size", None)
    info["sources"]["warp_size"] = "torch warp_size"
    if triton_properties:
        if triton_properties.get("max_shared_mem"):
            shared = triton_properties["max_shared_mem"]
            info["sources"]["shared_memory_per_block"] = "triton driver max_shared_mem"
        if triton_properties.get("warpSize"):
            warp = triton_properties["warpSize"]
            info["sources"]["warp_size"] = "triton driver warpSize"
    if not warp:
        iluvatar = any(mark in name.lower() for mark in ILUVATAR_NAME_MARKS) or hasattr(torch_module, "corex")
        warp = ILUVATAR_WARP_SIZE if iluvatar else DEFAULT_WARP_SIZE
        info["sources"]["warp_size"] = "default for the vendor (no driver property)"
    if not shared:
        info["sources"]["shared_memory_per_block"] = "not reported"
    info["warp_size"] = warp
    info["shared_memory_per_block"] = shared
    return info


def _read_first_line(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.readline().strip()
    except OSError:
        return None


def corex_version(environ=None, corex_root=COREX_ROOT):
    """The CoreX SDK version from its install directory (``/usr/local/corex -> corex-3.2.3``), or None."""
    roots = list((settings.corex_environment() if environ is None else environ).values()) + [corex_root]
    for root in roots:
        if not root or not os.path.isdir(root):
            continue
        resolved = os.path.basename(os.path.realpath(root))
        match = re.search(r"(\d+(?:\.\d+)+)", resolved)
        if match:
            return match.group(1)
        version_line = _read_first_line(os.path.join(root, "VERSION"))
        if version_line:
            return version_line
    return None


def nvidia_driver_version(driver_file=NVIDIA_DRIVER_FILE):
    """The NVIDIA kernel module's version from /proc (no process started), or None."""
    line = _read_first_line(driver_file)
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", line or "")
    return match.group(1) if match else None


def driver_fingerprint():
    """Cheap driver identity for the record's fingerprint: file reads only, no tool runs."""
    return {"nvidia": nvidia_driver_version(), "corex": corex_version()}


def _run_tool(argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"{argv[0]}: {error}"
    if done.returncode != 0:
        return None, f"{argv[0]} exited with {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    return done.stdout, None


def driver_details(vendor, which=shutil.which):
    """Driver and SDK versions for the record, asking ``nvidia-smi`` / ``ixsmi`` when files don't say."""
    details = dict(driver_fingerprint())
    if vendor == "nvidia" and not details["nvidia"] and which("nvidia-smi"):
        out, error = _run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        details["nvidia"] = out.splitlines()[0].strip() if out else None
        if error:
            details["nvidia_smi_error"] = error
    if vendor == "iluvatar" and which("ixsmi"):
        out, error = _run_tool(["ixsmi"])
        if out:
            match = re.search(r"Driver Version:\s*(\S+)", out)
            details["ixsmi_driver"] = match.group(1) if match else None
            match = re.search(r"CUDA Version:\s*(\S+)", out)
            details["ixsmi_cuda"] = match.group(1) if match else None
        if error:
            details["ixsmi_error"] = error
    return details
