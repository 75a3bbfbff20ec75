"""Test-wide conventions: which device the suite runs on, and where the golden data lies.

Without CUDA the Triton backend runs in Triton's interpreter, which must be switched on before
triton is first imported; with CUDA (the lent H200) the same tests run on real device tensors.
"""

import os
import pathlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def interpreter_runs_kernels():
    """Whether this machine can run our Triton kernels: on a GPU, or in Triton 3's interpreter (2.x's, the
    BI-V100's 2.3.1, cannot: its ``tl.multiple_of`` takes no scalar). Read from metadata: importing triton here
    would fix the interpreter choice too early."""
    from importlib import metadata
    try:
        major = int(metadata.version("triton").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return HAS_CUDA or major >= 3


def cli_runner():
    """A click ``CliRunner`` whose result keeps stdout and stderr apart (``result.stdout``, ``result.stderr``):
    click 8.2+ always does; 8.0-8.1 (the newest for Python 3.8) need ``mix_stderr=False``, which 8.2 removed."""
    from click.testing import CliRunner
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()


def golden_dir():
    """``BIV100_GOLDEN_DIR``, else ``../shared/golden`` beside the checkout."""
    configured = os.environ.get("BIV100_GOLDEN_DIR")
    return pathlib.Path(configured) if configured else REPO_ROOT.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


# Files whose tests share nothing costly (no module or session fixture worth building twice): under
# ``--dist loadgroup`` their tests spread over the workers one by one. Every other file stays on one worker.
SPREAD_PER_TEST = {"test_paged_attention_triton.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA-like device")
    skip_cpu_machine = pytest.mark.skip(reason="asserts a machine without a GPU")
    skip_kernels = pytest.mark.skip(reason="runs Triton kernels: needs a GPU or Triton 3's interpreter")
    runs_kernels = interpreter_runs_kernels()
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "cpu_machine" in item.keywords and HAS_CUDA:
            item.add_marker(skip_cpu_machine)
        if "triton_kernels" in item.keywords and not runs_kernels:
            item.add_marker(skip_kernels)
        if item.path.name not in SPREAD_PER_TEST:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
