"""Install, remove and inspect the import hook that brings the patch into every Python process.

Mechanisms (``install(mode=...)``; one at a time, installing one takes the other out):

``"pth"`` (default)
    ``biv100_patch_hook.pth`` in the interpreter's purelib (``sysconfig.get_paths()["purelib"]``)
    holding one guarded line: when the package is gone (uninstalled, the file left behind) or
    broken, the line does nothing and prints nothing. The name sorts after setuptools'
    ``__editable__*.pth``, so an editable install's path finder is in place when the line runs.
    On Python 3.15+ (PEP 829, detected by ``sys.version_info``) ``biv100_patch_hook.start`` is
    written beside it: its entry point ``biv100_patch.patches._startup:install`` replaces the
    ``.pth`` import line (which a matching ``.start`` file switches off, and which 3.18+ ignores).
    A ``.start`` entry point cannot be guarded: with the package uninstalled and the file left
    behind, Python 3.15+ prints one error line at start-up and carries on; ``biv100-patch
    remove`` (before uninstalling) or deleting the file ends that.
``"sitecustomize"``
    One guarded line appended to the sitecustomize.py the interpreter imports at start (created in
    purelib if there is none); ``remove()`` takes exactly that line out again, restoring the file
    byte for byte, and deletes the file (and its cached bytecode) when this module created it.

The third mechanism needs no file: the ``vllm.general_plugins`` entry point in setup.cfg, which
vLLM >= 0.5.5 calls in every process its engine starts.

Security: the hook runs in every process of the interpreter, so it refuses to write into a
directory that other users can write (group- or world-writable, unless sticky like /tmp for a
parent) or that a user other than root and you owns, and refuses when the biv100_patch code it
would run is in such a place. Files are written atomically with mode 0644 (sitecustomize.py keeps
its mode). At run time the finder checks the same for the code it hands vLLM to, before importing
it (``_startup.unsafe_code_locations``); ``status()`` reports any such problem.
"""

import importlib.machinery
import os
import site
import sys
import sysconfig
import tempfile

from . import _startup

PTH_NAME = "biv100_patch_hook.pth"
START_NAME = "biv100_patch_hook.start"
SITECUSTOMIZE_NAME = "sitecustomize.py"
MARKER = "# biv100-patch import hook"
# site.py executes a .pth line only when it starts with "import"; the exec'd try/except makes a
# missing or broken package a silent no-op instead of a traceback at every interpreter start.
PTH_LINE = ('import sys; exec("try:\\n from biv100_patch.patches._startup import install\\n'
            'except Exception:\\n pass\\nelse:\\n install()")  ' + MARKER + '; "biv100-patch remove" deletes this file\n')
START_LINE = "biv100_patch.patches._startup:install\n"
SITECUSTOMIZE_LINE = ('exec("try:\\n import biv100_patch.sitecustomize\\nexcept Exception:\\n pass")  '
                      + MARKER + '; "biv100-patch remove" takes this line out\n')
CREATED_HEADER = "# Created by biv100-patch for its import hook; \"biv100-patch remove\" deletes this file.\n"
MODES = ("pth", "sitecustomize")
START_FILES_SINCE = (3, 15)
FILE_MODE = 0o644


class HookError(Exception):
    """The hook cannot be installed or removed here; the message says why and what to do."""


def supports_start_files(version_info=None):
    """Whether this interpreter reads PEP 829 ``.start`` files (Python 3.15 and later)."""
    return tuple(version_info or sys.version_info)[:2] >= START_FILES_SINCE


def default_site_dir():
    return sysconfig.get_paths()["purelib"]


def install(mode="pth", site_dir=None):
    """Install the hook for this interpreter (``site_dir`` defaults to purelib); returns ``status()``.

    Idempotent. Raises ``HookError`` (and changes nothing) for an unknown mode, a missing or
    unsafe directory, or a sitecustomize.py it may not change.
    """
    if mode not in MODES:
        raise HookError(f"mode={mode!r} is not allowed; use one of {', '.join(MODES)}")
    site_dir = os.path.abspath(site_dir or default_site_dir())
    if not os.path.isdir(site_dir):
        raise HookError(f"site directory {site_dir} does not exist")
    if mode == "pth":
        _refuse_unsafe(site_dir)
        _write_atomic(os.path.join(site_dir, PTH_NAME), PTH_LINE.encode())
        if supports_start_files():
            _write_atomic(os.path.join(site_dir, START_NAME), START_LINE.encode())
        for path in _sitecustomize_paths(site_dir):
            _remove_sitecustomize_line(path)
    else:
        path = sitecustomize_path(site_dir)
        _refuse_unsafe(os.path.dirname(path), path)
        _add_sitecustomize_line(path)
        _remove_pth_files(site_dir)
    return status(site_dir)


def remove(site_dir=None):
    """Take every trace of the hook out; returns the paths it deleted or changed.

    Without ``site_dir`` it looks in every site directory of this interpreter.
    """
    changed = []
    for directory in _site_dirs(site_dir):
        changed.extend(_remove_pth_files(directory))
    for path in _sitecustomize_paths(site_dir):
        if _remove_sitecustomize_line(path):
            changed.append(path)
    return changed


def status(site_dir=None):
    """Which mechanism is installed where, whether this process runs the hook, and any problem.

    A dict (JSON-ready): ``installed`` lists ``{"mechanism", "path"}`` entries ("pth", "start",
    "sitecustomize"; a sitecustomize entry has its ``line`` number); ``entry_point`` is the
    vllm.general_plugins entry as importlib.metadata finds it (None if not found); ``problems``
    lists sentences (modified or unsafe files, a shadowed sitecustomize.py...).
    """
    installed, problems = [], []
    for directory in _site_dirs(site_dir):
        for mechanism, name, expected in (("pth", PTH_NAME, PTH_LINE), ("start", START_NAME, START_LINE)):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                continue
            installed.append({"mechanism": mechanism, "path": path})
            if _read_text(path) != expected:
                problems.append(f"{path} is not the file biv100-patch writes (changed by hand?)")
            if mechanism == "start" and not supports_start_files():
                problems.append(f"{path} is read only by Python 3.15+; this is {_python_version()}")
            problems.extend(_startup.unsafe_reasons(path))
    for path in _sitecustomize_paths(site_dir):
        number = _sitecustomize_line_number(path)
        if number is not None:
            installed.append({"mechanism": "sitecustomize", "path": path, "line": number})
            problems.extend(_startup.unsafe_reasons(path))
            shadow = _imported_sitecustomize()
            if shadow and os.path.realpath(shadow) != os.path.realpath(path):
                problems.append(f"{path} is not imported at start-up: {shadow} is found first")
    if installed:
        problems.extend(_startup.unsafe_code_locations())
    return {
        "python": sys.executable,
        "python_version": _python_version(),
        "start_files_supported": supports_start_files(),
        "installed": installed,
        "entry_point": _plugin_entry_point(),
        "switched_off": _startup.switched_off(),
        "active_in_this_process": _startup.installed(),
        "failure_in_this_process": _startup.failure,
        "problems": list(dict.fromkeys(problems)),
    }


def describe(report):
    """``status()`` as lines for a terminal."""
    lines = [f"import hook for {report['python']} (Python {report['python_version']}):"]
    for entry in report["installed"]:
        where = f"{entry['path']}, line {entry['line']}" if "line" in entry else entry["path"]
        lines.append(f"  {entry['mechanism']}: {where}")
    if not report["installed"]:
        lines.append("  not installed (run `biv100-patch apply`)")
    entry_point = report["entry_point"]
    lines.append(f"  vllm.general_plugins: {entry_point['name']} = {entry_point['value']}" if entry_point
                 else "  vllm.general_plugins: entry point not found (is biv100-patch installed?)")
    if report["switched_off"]:
        lines.append("  switched off in this environment (BIV100_PATCH=0 or BIV100_PATCH_BACKEND=off)")
    lines.extend(f"  problem: {problem}" for problem in report["problems"])
    return lines


def sitecustomize_path(site_dir=None):
    """The sitecustomize.py the hook line goes into.

    With ``site_dir``: the one in it. Otherwise the one this interpreter imported at start-up,
    else the one it would find, else a new one in purelib.
    """
    if site_dir is not None and os.path.abspath(site_dir) != os.path.abspath(default_site_dir()):
        return os.path.join(os.path.abspath(site_dir), SITECUSTOMIZE_NAME)
    existing = _imported_sitecustomize()
    if not existing:
        return os.path.join(default_site_dir(), SITECUSTOMIZE_NAME)
    if not existing.endswith(".py"):
        raise HookError(f"the interpreter's sitecustomize is {existing}, not a .py file biv100-patch can edit; "
                        "use the .pth hook (biv100-patch apply without --sitecustomize)")
    if not _inside(existing, sys.prefix):
        # A venv of a distribution's Python imports the base's sitecustomize.py (the stdlib comes first
        # on sys.path, so one in the venv would be shadowed): editing it would hook every user's Python.
        raise HookError(f"this interpreter imports {existing}, which belongs to the Python outside this "
                        f"environment ({sys.prefix}); use the .pth hook (biv100-patch apply without "
                        "--sitecustomize), or add `import biv100_patch.sitecustomize` to that file yourself")
    return existing


def _sitecustomize_paths(site_dir):
    """The sitecustomize.py files our line may be in (one per site directory we look at)."""
    paths = []
    for directory in _site_dirs(site_dir):
        try:
            paths.append(sitecustomize_path(directory))
        except HookError:  # a compiled sitecustomize holds no line of ours
            continue
    return list(dict.fromkeys(paths))


def _imported_sitecustomize():
    module = sys.modules.get("sitecustomize")
    origin = getattr(module, "__file__", None)
    if origin:
        return origin
    startup_path = sys.path[0 if getattr(sys.flags, "safe_path", False) else 1:]  # without the script's dir
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", startup_path)
    return spec.origin if spec is not None and spec.has_location else None


def _inside(path, directory):
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


def _site_dirs(site_dir):
    if site_dir is not None:
        return [os.path.abspath(site_dir)]
    candidates = [default_site_dir(), sysconfig.get_paths()["platlib"]]
    candidates.extend(getattr(site, "getsitepackages", lambda: [])())
    candidates.append(site.getusersitepackages())
    return [path for path in dict.fromkeys(map(os.path.abspath, candidates)) if os.path.isdir(path)]


def _refuse_unsafe(directory, *files):
    reasons = _startup.unsafe_reasons(directory)
    for path in files:
        if os.path.exists(path):
            reasons.extend(_startup.unsafe_reasons(path))
    reasons.extend(_startup.unsafe_code_locations())
    if reasons:
        raise HookError("refusing to install a hook that every process of this interpreter runs: "
                        + "; ".join(dict.fromkeys(reasons))
                        + ". Make these writable only by their owner (root or you), or install elsewhere")


def _write_atomic(path, data, mode=FILE_MODE):
    directory, name = os.path.split(path)
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    except OSError as error:
        raise HookError(f"cannot write {path}: {error.strerror or error}") from error
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fchmod(stream.fileno(), mode)
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise HookError(f"cannot write {path}: {error.strerror or error}") from error
        raise


def _remove_pth_files(directory):
    removed = []
    for name in (PTH_NAME, START_NAME):
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise HookError(f"cannot remove {path}: {error.strerror or error}") from error
        removed.append(path)
    return removed


def _add_sitecustomize_line(path):
    real = os.path.realpath(path)
    if not os.path.exists(real):
        _write_atomic(real, (CREATED_HEADER + SITECUSTOMIZE_LINE).encode())
        return
    content = _read_bytes(real)
    if _sitecustomize_line_number(real) is not None:
        return
    line = SITECUSTOMIZE_LINE.encode()
    if content and not content.endswith(b"\n"):
        line = b"\n" + line.rstrip(b"\n")  # keep the file's unterminated last line unterminated
    _write_atomic(real, content + line, mode=os.stat(real).st_mode & 0o7777)


def _remove_sitecustomize_line(path):
    """Take our line out of ``path``; delete the file if we created it. True when it changed."""
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        return False
    content = _read_bytes(real)
    line = SITECUSTOMIZE_LINE.encode()
    unterminated = b"\n" + line.rstrip(b"\n")
    if content.endswith(unterminated):
        restored = content[:-len(unterminated)]
    elif content.startswith(line) or b"\n" + line in content:
        at = 0 if content.startswith(line) else content.index(b"\n" + line) + 1
        restored = content[:at] + content[at + len(line):]
    else:
        return False
    if restored == CREATED_HEADER.encode():
        _unlink_with_cache(real)
    else:
        _write_atomic(real, restored, mode=os.stat(real).st_mode & 0o7777)
    return True


def _sitecustomize_line_number(path):
    try:
        lines = _read_bytes(os.path.realpath(path)).split(b"\n")
    except (OSError, HookError):
        return None
    ours = SITECUSTOMIZE_LINE.encode().rstrip(b"\n")
    return next((number for number, line in enumerate(lines, 1) if line == ours), None)


def _unlink_with_cache(path):
    import importlib.util

    try:
        os.unlink(path)
    except OSError as error:
        raise HookError(f"cannot remove {path}: {error.strerror or error}") from error
    for cached in (importlib.util.cache_from_source(path, optimization=level) for level in ("", 1, 2)):
        try:
            os.unlink(cached)
        except OSError:
            pass
    try:
        os.rmdir(os.path.join(os.path.dirname(path), "__pycache__"))  # only if it is empty now
    except OSError:
        pass


def _read_bytes(path):
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except OSError as error:
        raise HookError(f"cannot read {path}: {error.strerror or error}") from error


def _read_text(path):
    try:
        return _read_bytes(path).decode("utf-8")
    except (HookError, UnicodeDecodeError):
        return None


def _python_version():
    return ".".join(map(str, sys.version_info[:3]))


def _plugin_entry_point():
    from importlib.metadata import entry_points

    for entry_point in _entry_points_in_group(entry_points, "vllm.general_plugins"):
        if entry_point.value.startswith("biv100_patch."):
            return {"name": entry_point.name, "value": entry_point.value}
    return None


def _entry_points_in_group(entry_points, group):
    try:
        return entry_points(group=group)  # Python 3.10+, as vLLM looks it up
    except TypeError:
        return entry_points().get(group, [])
