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
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "cpu_machine" in item.keywords and HAS_CUDA:
            item.add_marker(skip_cpu_machine)
        if item.path.name not in SPREAD_PER_TEST:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
