"""The Triton backend's launcher (``paged_attention_triton._Launcher``), with fakes for Triton's JIT and
compiled kernels (no GPU): the first launch of a specialisation goes through the JIT with the tensors put
back; later ones call the compiled kernel's launcher with raw addresses, in the layout of the Triton
version; a launcher that refuses those arguments sends the kernel back to the JIT for good.
On the H200, tests/test_paged_attention_triton.py runs the real launchers (Triton 3.6 and 2.3.1)."""

import types

from kernels import paged_attention_triton as pat

STREAM = 77
DEVICE = types.SimpleNamespace(index=0)
GRID = (3, 2, 1)
ARGS = (0x1000, 5)         # out_ptr as an address, n
TENSORS = ("out tensor",)  # what the JIT gets back at out_ptr's position


class Kernel23:
    """A compiled kernel as Triton 2.3 returns it from ``JITFunction.run``."""

    num_warps, num_ctas, cluster_dims, shared, function = 2, 1, (1, 1, 1), 4096, 0xF00
    tensormaps_info = []

    def __init__(self, refuse=False):
        self.calls, self.refuse = [], refuse

    def run(self, *args):
        if self.refuse:  # a launcher of another layout: PyArg_ParseTuple fails before launching
            raise TypeError("function takes exactly 17 arguments (16 given)")
        self.calls.append(args)


class Kernel3:
    """A compiled kernel as Triton 3.x returns it (``kernel.run`` wraps the launch)."""

    function, packed_metadata = 0xF00, ("metadata",)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class Jit:
    """``JITFunction``: ``fn[grid](*args, **constexprs)`` compiles (or finds) and launches, returns the kernel."""

    arg_names = ["out_ptr", "n", "BLOCK"]

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.calls.append((grid, args, constants))
            return self.kernel
        return launch


def launcher_for(monkeypatch, kernel, version):
    monkeypatch.setattr(pat, "_TRITON_VERSION", version)
    monkeypatch.setattr(pat, "_BARE_LAUNCH", False)
    monkeypatch.setattr(pat, "_current_stream", lambda index: STREAM)
    jit = Jit(kernel)
    launcher = pat._Launcher(jit)
    launcher.direct = True
    return launcher, jit


def launch(launcher, key="shape"):
    launcher(key, GRID, DEVICE, ARGS, TENSORS, lambda: {"BLOCK": 64})


def test_triton_2_3_launches_directly_after_the_first_call(monkeypatch):
    kernel = Kernel23()
    launcher, jit = launcher_for(monkeypatch, kernel, (2, 3))
    launch(launcher)
    assert jit.calls == [(GRID, ("out tensor", 5), {"BLOCK": 64})] and kernel.calls == []
    launch(launcher)
    launch(launcher)
    # run(grid, num_warps, num_ctas, cluster, shared, stream, function, hooks, kernel, *non-constexpr args)
    expected = (3, 2, 1, 2, 1, 1, 1, 1, 4096, STREAM, 0xF00, None, None, kernel, 0x1000, 5)
    assert kernel.calls == [expected, expected] and len(jit.calls) == 1
    launch(launcher, key="another shape")  # a new specialisation: the JIT first
    assert len(jit.calls) == 2 and len(kernel.calls) == 2


def test_a_launcher_that_refuses_the_direct_call_sends_the_kernel_back_to_the_jit(monkeypatch):
    kernel = Kernel23(refuse=True)
    launcher, jit = launcher_for(monkeypatch, kernel, (2, 3))
    for _ in range(3):
        launch(launcher)
    assert len(jit.calls) == 3 and not launcher.direct and launcher.kernels == {}
    assert all(call == (GRID, ("out tensor", 5), {"BLOCK": 64}) for call in jit.calls)


def test_triton_2_3_kernels_with_tensor_maps_stay_on_the_jit(monkeypatch):
    kernel = Kernel23()
    kernel.tensormaps_info = ["a TMA descriptor"]
    launcher, jit = launcher_for(monkeypatch, kernel, (2, 3))
    launch(launcher)
    launch(launcher)
    assert len(jit.calls) == 2 and kernel.calls == []


def test_triton_3_launches_directly_with_the_constexprs_last(monkeypatch):
    kernel = Kernel3()
    launcher, jit = launcher_for(monkeypatch, kernel, (3, 4))
    launch(launcher)
    launch(launcher)
    assert kernel.calls == [(3, 2, 1, STREAM, 0xF00, ("metadata",), None, None, None, 0x1000, 5, 64)]
    assert len(jit.calls) == 1

