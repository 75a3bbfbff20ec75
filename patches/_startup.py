"""The import hook's start-up half: tiny, lazy, and unable to break the interpreter.

At interpreter start the ``biv100_patch_hook.pth`` line (or ``import biv100_patch.sitecustomize``
in a sitecustomize.py, or the PEP 829 ``biv100_patch_hook.start`` entry point) calls
``install()``. It reads the off switch and puts one ``CustomOpsFinder`` at the front of
``sys.meta_path``: nothing else, and nothing beyond ``os`` and ``sys`` is imported (no torch, no
triton, no vllm, no click, no platformdirs), so a process that never imports vLLM pays a few
hundred microseconds (``benchmarks/bench_hook_startup.py`` measures it).

The finder ignores every import except ``vllm._custom_ops`` (not ``vllm``: the ops module is what
the patch replaces, and vLLM imports it half-way through its own ``__init__``). For that one module
it asks the real finders behind it for the spec, lets the real loader execute the module, and
then hands the module to the patcher (``biv100_patch.patches``), before anyone can call an op.

Failure never reaches the user's code: any exception in the hook or the patcher is caught,
logged once at WARNING on the ``biv100_patch`` logger, kept in ``failure`` and added to the
decision record's events (``probe.record_runtime_event``); vLLM then imports unpatched. A hand-off that
would execute patcher code from a directory other users can write is refused the same way.

Off switch: ``BIV100_PATCH=0`` (also false/no/off) or ``BIV100_PATCH_BACKEND=off`` leaves the
process alone: no finder is installed. ``probe/settings.py`` is the one full parser of these
variables; importing it here would pull in platformdirs (about 15 ms), so ``switched_off()``
reads only the "off" answers, from the same value table (tests/test_hook.py checks the two agree).
A malformed value is not "off": the finder is installed and the patcher, which reads the
variables through settings.py, reports the bad value once.

Interpreter flags:

- ``python -S`` does not import ``site``: no ``.pth``/``.start`` file and no sitecustomize.py is
  processed, so the hook does not run (site-packages are not on ``sys.path`` either; if vLLM is
  reached through ``PYTHONPATH`` anyway, the ``vllm.general_plugins`` entry point still applies
  the patch in every process vLLM's engine starts).
- ``python -I`` (= ``-E -s -P``) still imports ``site``: the hook in the interpreter's
  site-packages and sitecustomize.py runs; a hook installed into the *user* site-packages does
  not (``-s``). ``-E`` ignores only ``PYTHON*`` variables, so ``BIV100_PATCH=0`` still works.
- multiprocessing ``spawn``/``forkserver`` children and Ray workers are fresh interpreters: the
  hook runs again in each. ``fork`` children inherit the already patched module.
"""

import os
import sys

TARGET = "vllm._custom_ops"

# The false answers of probe/settings.py's _SWITCH_VALUES (BIV100_PATCH) and the "off" choice of
# BACKEND_CHOICES (BIV100_PATCH_BACKEND), compared after .strip().lower() as settings.py does.
OFF_SWITCH_VALUES = ("0", "false", "no", "off")
OFF_BACKEND = "off"

failure = None  # dict(stage, error, message) of the first failure in this process, else None
handed_off = False  # True once vllm._custom_ops was given to the patcher without an exception


def switched_off(environ=os.environ):
    """True when ``BIV100_PATCH`` or ``BIV100_PATCH_BACKEND`` says off (cheap: no imports)."""
    return (environ.get("BIV100_PATCH", "").strip().lower() in OFF_SWITCH_VALUES
            or environ.get("BIV100_PATCH_BACKEND", "").strip().lower() == OFF_BACKEND)


class CustomOpsFinder:
    """A meta-path finder that only watches for ``vllm._custom_ops``.

    It never creates a spec itself: it returns the spec of the finders behind it, with the
    loader's ``exec_module`` wrapped so that the patcher runs right after the module executed.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        try:
            spec = _spec_from_finders_behind(self, fullname, path, target)
            if spec is not None and getattr(spec.loader, "exec_module", None) is not None:
                _patch_after_exec(spec.loader)
            return spec
        except Exception as exc:  # the import goes on without us, exactly as without the hook
            _fail("finding vllm._custom_ops", exc)
            return None


def _spec_from_finders_behind(finder, fullname, path, target):
    finders = list(sys.meta_path)
    behind = finders[finders.index(finder) + 1:] if finder in finders else finders
    for other in behind:
        find_spec = getattr(other, "find_spec", None)
        if find_spec is not None and not _is_ours(other):
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
    return None


def _patch_after_exec(loader):
    exec_module = loader.exec_module

    def exec_module_then_patch(module):
        exec_module(module)  # vLLM's own errors propagate untouched
        if getattr(module, "__name__", None) == TARGET:  # a loader may serve several modules (zipimport)
            hand_off(module)

    loader.exec_module = exec_module_then_patch


def hand_off(module):
    """Give the executed ``vllm._custom_ops`` to the patcher; never raises."""
    global handed_off
    try:
        unsafe = unsafe_code_locations()
        if unsafe:
            _fail("patching vllm._custom_ops", PermissionError(
                "other users can write code the patch would run: " + "; ".join(unsafe)), record=False)
            return
        from biv100_patch import patches

        patches.on_custom_ops_loaded(module)
        handed_off = True
    except Exception as exc:
        _fail("patching vllm._custom_ops", exc)


def install():
    """Put the finder on ``sys.meta_path`` unless switched off; idempotent; never raises."""
    try:
        if switched_off() or any(_is_ours(finder) for finder in sys.meta_path):
            return
        sys.meta_path.insert(0, CustomOpsFinder())
        module = sys.modules.get(TARGET)
        if module is not None:  # installed late (from user code), after vLLM was imported
            hand_off(module)
    except Exception as exc:
        _fail("installing the import hook", exc)


def installed():
    """Whether this process has the finder on ``sys.meta_path``."""
    return any(_is_ours(finder) for finder in sys.meta_path)


def _is_ours(finder):
    kind = type(finder)
    return kind.__name__ == CustomOpsFinder.__name__ and kind.__module__ == __name__


def unsafe_code_locations():
    """Reasons why other users could change the biv100_patch code the patch executes.

    Checks the directories of biv100_patch and its subpackages, their Python files and caches,
    and every directory above them (a parent writable by others lets them swap the whole tree,
    unless it is sticky like /tmp). Only root and the current user may own any of it.
    """
    from importlib.util import find_spec

    package_dirs = []
    for name in ("biv100_patch", "biv100_patch.patches", "biv100_patch.probe", "biv100_patch.kernels"):
        spec = find_spec(name)
        package_dirs.extend((spec.submodule_search_locations or []) if spec is not None else [])
    reasons = []
    for directory in dict.fromkeys(os.path.realpath(path) for path in package_dirs):
        reasons.extend(unsafe_reasons(directory, contents=True))
    return list(dict.fromkeys(reasons))


def unsafe_reasons(path, contents=False):
    """Why other users could change what ``path`` is (and, with contents, the .py/.pyc under it)."""
    path = os.path.realpath(path)
    reasons = []
    checked = [(path, False)]
    parent = os.path.dirname(path)
    while True:
        checked.append((parent, True))
        above = os.path.dirname(parent)
        if above == parent:
            break
        parent = above
    if contents and os.path.isdir(path):
        for sub in (path, os.path.join(path, "__pycache__")):
            if os.path.isdir(sub):
                checked.extend((entry.path, False) for entry in os.scandir(sub)
                               if entry.name.endswith((".py", ".pyc")) or entry.name == "__pycache__")
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for item, sticky_ok in checked:
        try:
            info = os.stat(item)
        except OSError:
            continue
        if uid is not None and info.st_uid not in (0, uid):
            reasons.append(f"{item} belongs to uid {info.st_uid}")
        elif info.st_mode & 0o022 and not (sticky_ok and info.st_mode & 0o1000):
            who = "everyone" if info.st_mode & 0o002 else "its group"
            reasons.append(f"{item} is writable by {who} (mode {info.st_mode & 0o7777:o})")
    return reasons


def _fail(stage, exc, record=True):
    """Log once at WARNING, keep the first failure, and add it to the decision record's events."""
    global failure
    first = failure is None
    if first:
        failure = {"stage": stage, "error": type(exc).__name__, "message": str(exc)}
    try:
        import logging

        if first:
            logging.getLogger("biv100_patch").warning(
                "biv100-patch import hook: %s failed (%s: %s); vLLM runs unpatched",
                stage, type(exc).__name__, exc)
            if record:  # not when the failure is that our code sits where others can change it
                from biv100_patch import probe

                probe.record_runtime_event({"event": "import_hook_failed", **failure})
    except Exception:  # a broken logging or record must not take the process down
        pass
