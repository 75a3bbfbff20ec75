"""The import hook: its files, its off switch, its finder, and real vLLM 0.6.3 in a throwaway venv.

Fast tests use the dev interpreter (a stub ``vllm`` package where a finder test needs one). The
``slow`` tests build one venv per session from the vLLM 0.6.3 env's interpreter, see that env's
packages through a ``.pth`` line (no reinstall), install this package into it (a regular, not an
editable, install) and then the hook, and run subprocesses there. When CI=true a missing vLLM env
fails them instead of skipping.
"""

import concurrent.futures
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
import types

import pytest

from biv100_patch.patches import _startup, hook
from biv100_patch.probe import settings

from .conftest import REPO_ROOT

VLLM_ENV = REPO_ROOT / ".ci" / "envs" / "vllm-0.6.3"
HEAVY_MODULES = ("torch", "triton", "vllm", "click", "platformdirs", "filelock", "packaging")
PACKAGE_FILES = ("setup.cfg", "pyproject.toml", "README.md", "bin", "probe", "kernels", "patches")


def clean_env(**extra):
    """The test process's environment without anything that would steer the child's imports."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("BIV100_", "PYTHON", "VIRTUAL_ENV", "VLLM_"))}
    env.update(extra)
    return env


def run_python(python, code, *flags, env=None, cwd=None, timeout=300):
    return subprocess.run([str(python), *flags, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env(), cwd=cwd)


def result_of(completed):
    """The JSON a child printed on its last ``RESULT`` line."""
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line; stdout={completed.stdout[-2000:]!r} stderr={completed.stderr[-4000:]!r}"
    return json.loads(lines[-1][len("RESULT "):])


# --- the off switch -------------------------------------------------------------------------------

def settings_say_off(environ, monkeypatch):
    for name in ("BIV100_PATCH", "BIV100_PATCH_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    try:
        return not settings.patch_enabled() or settings.backend_override() == "off"
    except settings.SettingsError:
        return False  # a bad value is reported by the patcher, not taken for "off"


@pytest.mark.parametrize("environ", [
    {}, {"BIV100_PATCH": "0"}, {"BIV100_PATCH": " OFF "}, {"BIV100_PATCH": "False"}, {"BIV100_PATCH": "no"},
    {"BIV100_PATCH": "1"}, {"BIV100_PATCH": "on"}, {"BIV100_PATCH": ""}, {"BIV100_PATCH": "maybe"},
    {"BIV100_PATCH": "00"}, {"BIV100_PATCH_BACKEND": "off"}, {"BIV100_PATCH_BACKEND": " Off"},
    {"BIV100_PATCH_BACKEND": "torch"}, {"BIV100_PATCH_BACKEND": "offf"}, {"BIV100_PATCH_BACKEND": "0"},
    {"BIV100_PATCH": "1", "BIV100_PATCH_BACKEND": "off"}, {"BIV100_PATCH": "0", "BIV100_PATCH_BACKEND": "triton"},
])
def test_cheap_off_switch_agrees_with_settings(environ, monkeypatch):
    assert _startup.switched_off(environ) is settings_say_off(environ, monkeypatch)


def test_off_values_are_the_settings_false_values():
    assert set(_startup.OFF_SWITCH_VALUES) == {raw for raw, value in settings._SWITCH_VALUES.items() if not value}
    assert _startup.OFF_BACKEND in settings.BACKEND_CHOICES


# --- the finder, against a stub vllm package ------------------------------------------------------

@pytest.fixture(scope="module")
def stub_vllm(tmp_path_factory):
    """A ``vllm`` package whose ``_custom_ops`` marks that it ran to its last line."""
    root = tmp_path_factory.mktemp("stub-vllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_custom_ops.py").write_text(
        "def paged_attention_v1(*args):\n    return 'vllm'\n\n\nEXECUTED_TO_THE_END = True\n")
    return root


def run_with_stub(stub_vllm, body, **env):
    prologue = textwrap.dedent("""\
        import json, sys
        import biv100_patch.patches as patches
        from biv100_patch.patches import _startup
        seen = []
        """)
    return run_python(sys.executable, prologue + textwrap.dedent(body), env=clean_env(PYTHONPATH=str(stub_vllm), **env))


def test_finder_hands_over_vllm_custom_ops_after_it_executed(stub_vllm):
    completed = run_with_stub(stub_vllm, """
        patches.on_custom_ops_loaded = lambda module: seen.append((module.__name__, module.EXECUTED_TO_THE_END))
        _startup.install()
        _startup.install()  # idempotent
        import vllm
        assert not seen, "importing vllm alone must not trigger the patch"
        import vllm._custom_ops
        finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "CustomOpsFinder"]
        print("RESULT " + json.dumps({"seen": seen, "finders": len(finders), "handed_off": _startup.handed_off,
                                      "failure": _startup.failure, "first": type(sys.meta_path[0]).__name__}))
        """)
    result = result_of(completed)
    assert result == {"seen": [["vllm._custom_ops", True]], "finders": 1, "handed_off": True, "failure": None,
                      "first": "CustomOpsFinder"}
    assert completed.stderr == ""


def test_finder_installed_after_vllm_patches_at_once(stub_vllm):
    result = result_of(run_with_stub(stub_vllm, """
        import vllm._custom_ops
        patches.on_custom_ops_loaded = lambda module: seen.append(module.__name__)
        _startup.install()
        print("RESULT " + json.dumps({"seen": seen, "handed_off": _startup.handed_off}))
        """))
    assert result == {"seen": ["vllm._custom_ops"], "handed_off": True}


def test_a_raising_patcher_is_logged_once_recorded_and_vllm_still_imports(stub_vllm, tmp_path):
    state = tmp_path / "state"
    completed = run_with_stub(stub_vllm, """
        import importlib
        def broken(module):
            raise RuntimeError("injected failure in on_custom_ops_loaded")
        patches.on_custom_ops_loaded = broken
        _startup.install()
        import vllm._custom_ops as ops
        importlib.reload(ops)  # the loader runs again: a second failure, still one warning
        print("RESULT " + json.dumps({"call": ops.paged_attention_v1(), "failure": _startup.failure,
                                      "handed_off": _startup.handed_off}))
        """, BIV100_PATCH_HOME=str(state))
    result = result_of(completed)
    assert result["call"] == "vllm" and result["handed_off"] is False
    assert result["failure"] == {"stage": "patching vllm._custom_ops", "error": "RuntimeError",
                                 "message": "injected failure in on_custom_ops_loaded"}
    warnings = [line for line in completed.stderr.splitlines() if "import hook" in line]
    assert warnings == ["biv100-patch import hook: patching vllm._custom_ops failed (RuntimeError: injected "
                        "failure in on_custom_ops_loaded); vLLM runs unpatched"], completed.stderr
    events = [json.loads(line) for path in state.glob("events-*.jsonl") for line in path.read_text().splitlines()]
    assert [(event["kind"], event["message"]) for event in events] == [
        ("import_hook_failed", "injected failure in on_custom_ops_loaded")]


def test_hand_off_refuses_code_other_users_can_write(stub_vllm):
    completed = run_with_stub(stub_vllm, """
        _startup.unsafe_code_locations = lambda: ["/somewhere/biv100_patch is writable by everyone (mode 777)"]
        patches.on_custom_ops_loaded = lambda module: seen.append(module.__name__)
        _startup.install()
        import vllm._custom_ops
        print("RESULT " + json.dumps({"seen": seen, "failure": _startup.failure,
                                      "apply_imported": "biv100_patch.patches.apply" in sys.modules}))
        """)
    result = result_of(completed)
    assert result["seen"] == [] and result["apply_imported"] is False
    assert result["failure"]["error"] == "PermissionError"
    assert "/somewhere/biv100_patch is writable by everyone" in completed.stderr


def test_finder_ignores_every_other_module():
    finder = _startup.CustomOpsFinder()
    assert finder.find_spec("json", None) is None
    assert finder.find_spec("vllm", None) is None
    assert finder.find_spec("vllm._custom_ops_extra", None) is None


def test_a_shared_loader_hands_over_only_vllm_custom_ops(monkeypatch):
    handed = []
    monkeypatch.setattr(_startup, "hand_off", lambda module: handed.append(module.__name__))

    class SharedLoader:  # like zipimport's: one loader object for every module of an archive
        def exec_module(self, module):
            module.executed = True

    loader = SharedLoader()
    _startup._patch_after_exec(loader)
    modules = [types.ModuleType(name) for name in ("vllm.other", "vllm._custom_ops", "json")]
    for module in modules:
        loader.exec_module(module)
    assert handed == ["vllm._custom_ops"] and all(module.executed for module in modules)


def test_unsafe_reasons_name_what_others_can_write(tmp_path):
    parent = tmp_path / "parent"
    package = parent / "package"
    package.mkdir(parents=True)
    (package / "module.py").write_text("")
    parent.chmod(0o755)
    package.chmod(0o755)
    assert _startup.unsafe_reasons(str(package), contents=True) == []
    (package / "module.py").chmod(0o666)
    assert _startup.unsafe_reasons(str(package), contents=True) == [
        f"{package / 'module.py'} is writable by everyone (mode 666)"]
    (package / "module.py").chmod(0o644)
    package.chmod(0o775)
    assert _startup.unsafe_reasons(str(package)) == [f"{package} is writable by its group (mode 775)"]
    package.chmod(0o755)
    parent.chmod(0o1777)  # sticky, like /tmp: others cannot move our entries
    assert _startup.unsafe_reasons(str(package)) == []
    parent.chmod(0o777)
    assert _startup.unsafe_reasons(str(package)) == [f"{parent} is writable by everyone (mode 777)"]
    parent.chmod(0o755)


# --- the files: .pth/.start and sitecustomize.py --------------------------------------------------

@pytest.fixture
def site_dir(tmp_path):
    directory = tmp_path / "site-packages"
    directory.mkdir()
    directory.chmod(0o755)
    return directory


def test_pth_install_writes_one_guarded_line_and_remove_leaves_nothing(site_dir):
    report = hook.install("pth", str(site_dir))
    pth = site_dir / hook.PTH_NAME
    assert pth.read_text() == hook.PTH_LINE and pth.read_text().count("\n") == 1
    assert stat.S_IMODE(pth.stat().st_mode) == 0o644
    assert hook.install("pth", str(site_dir))["installed"] == report["installed"]  # idempotent
    assert report["installed"] == [{"mechanism": "pth", "path": str(pth)}]
    assert report["problems"] == []
    assert hook.remove(str(site_dir)) == [str(pth)]
    assert list(site_dir.iterdir()) == []
    assert hook.status(str(site_dir))["installed"] == []


def test_start_file_written_beside_the_pth_where_pep_829_applies(site_dir, monkeypatch):
    assert hook.supports_start_files((3, 15, 0)) and hook.supports_start_files((3, 16))
    assert not hook.supports_start_files((3, 14, 9)) and not hook.supports_start_files((3, 8))
    monkeypatch.setattr(hook, "supports_start_files", lambda version_info=None: True)
    hook.install("pth", str(site_dir))
    assert (site_dir / hook.START_NAME).read_text() == "biv100_patch.patches._startup:install\n"
    assert sorted(entry["mechanism"] for entry in hook.status(str(site_dir))["installed"]) == ["pth", "start"]
    assert sorted(hook.remove(str(site_dir))) == sorted([str(site_dir / hook.PTH_NAME), str(site_dir / hook.START_NAME)])
    assert list(site_dir.iterdir()) == []


def test_the_start_entry_point_names_a_callable():
    module, _, attribute = hook.START_LINE.strip().partition(":")
    assert module == _startup.__name__ and callable(getattr(_startup, attribute))


@pytest.mark.parametrize("original", [None, b"", b"import os\n", b"import os\nprint('no newline at the end')",
                                      b"# -*- coding: utf-8 -*-\r\nimport os\r\n"],
                         ids=["absent", "empty", "terminated", "unterminated", "crlf"])
def test_sitecustomize_line_added_once_and_taken_out_byte_for_byte(site_dir, original):
    path = site_dir / "sitecustomize.py"
    if original is not None:
        path.write_bytes(original)
        path.chmod(0o640)
    report = hook.install("sitecustomize", str(site_dir))
    hook.install("sitecustomize", str(site_dir))
    content = path.read_bytes()
    before = hook.CREATED_HEADER.encode() if original is None else original
    assert content.count(hook.SITECUSTOMIZE_LINE.rstrip("\n").encode()) == 1
    assert content.startswith(before)
    line = len(before.split(b"\n")) + (0 if before == b"" or before.endswith(b"\n") else 1)
    assert report["installed"] == [{"mechanism": "sitecustomize", "path": str(path), "line": line}]
    compile(content, str(path), "exec")
    assert not (site_dir / hook.PTH_NAME).exists()
    assert hook.remove(str(site_dir)) == [str(path)]
    if original is None:
        assert list(site_dir.iterdir()) == []
    else:
        assert path.read_bytes() == original
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert sorted(entry.name for entry in site_dir.iterdir()) == ["sitecustomize.py"]


def test_sitecustomize_of_the_python_outside_the_venv_is_left_alone(tmp_path, monkeypatch):
    outside = tmp_path / "base-python" / "lib" / "sitecustomize.py"
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"import os\n")
    monkeypatch.setattr(hook, "_imported_sitecustomize", lambda: str(outside))
    with pytest.raises(hook.HookError, match="belongs to the Python outside this environment"):
        hook.install("sitecustomize")
    assert outside.read_bytes() == b"import os\n"


def test_switching_mechanisms_leaves_only_one(site_dir):
    (site_dir / "sitecustomize.py").write_bytes(b"import os\n")
    hook.install("sitecustomize", str(site_dir))
    hook.install("pth", str(site_dir))
    assert (site_dir / "sitecustomize.py").read_bytes() == b"import os\n"
    assert [entry["mechanism"] for entry in hook.status(str(site_dir))["installed"]] == ["pth"]
    hook.install("sitecustomize", str(site_dir))
    assert not (site_dir / hook.PTH_NAME).exists()
    assert [entry["mechanism"] for entry in hook.status(str(site_dir))["installed"]] == ["sitecustomize"]


def test_install_refuses_a_site_dir_others_can_write(site_dir):
    site_dir.chmod(0o777)
    with pytest.raises(hook.HookError, match=f"{site_dir} is writable by everyone"):
        hook.install("pth", str(site_dir))
    with pytest.raises(hook.HookError, match="writable by everyone"):
        hook.install("sitecustomize", str(site_dir))
    assert list(site_dir.iterdir()) == []
    site_dir.chmod(0o755)


def test_install_rejects_an_unknown_mode_and_a_missing_dir(tmp_path):
    with pytest.raises(hook.HookError, match="mode='usercustomize' is not allowed; use one of pth, sitecustomize"):
        hook.install("usercustomize", str(tmp_path))
    with pytest.raises(hook.HookError, match="does not exist"):
        hook.install("pth", str(tmp_path / "missing"))


def test_status_reports_a_changed_pth_file(site_dir):
    hook.install("pth", str(site_dir))
    (site_dir / hook.PTH_NAME).write_text("import os\n")
    report = hook.status(str(site_dir))
    assert report["installed"] == [{"mechanism": "pth", "path": str(site_dir / hook.PTH_NAME)}]
    assert report["problems"] == [f"{site_dir / hook.PTH_NAME} is not the file biv100-patch writes (changed by hand?)"]
    assert any("pth:" in line for line in hook.describe(report))


@pytest.mark.parametrize("package", [None, "raise RuntimeError('broken package')\n", "syntax error here\n"],
                         ids=["missing", "raising", "syntax-error"])
def test_the_pth_line_is_silent_when_the_package_is_missing_or_broken(site_dir, package):
    (site_dir / hook.PTH_NAME).write_text(hook.PTH_LINE)
    if package is not None:
        (site_dir / "biv100_patch").mkdir()
        (site_dir / "biv100_patch" / "__init__.py").write_text(package)
    # -S: no site-packages of ours (nor the dev install's finder); addsitedir processes the .pth.
    completed = run_python(sys.executable, f"import site, sys; site.addsitedir({str(site_dir)!r}); "
                           "print('RESULT ' + str(int(any(type(f).__name__ == 'CustomOpsFinder' for f in sys.meta_path))))",
                           "-S", cwd=str(site_dir.parent))
    assert result_of(completed) == 0
    assert completed.stderr == ""


# --- real vLLM 0.6.3 in a throwaway venv ----------------------------------------------------------

class HookVenv:
    """A throwaway venv that sees the vLLM env's packages and has biv100-patch installed."""

    def __init__(self, root):
        self.root = root
        self.python = root / "venv" / "bin" / "python"
        self.state = root / "state"
        self.purelib = None

    def run(self, code, *flags, timeout=300, **env):
        return run_python(self.python, code, *flags, env=self.env(**env), cwd=str(self.root), timeout=timeout)

    def env(self, **extra):
        return clean_env(**{"BIV100_PATCH_HOME": str(self.state), **extra})

    def hook(self, call):
        return result_of(self.run("import json; from biv100_patch.patches import hook; "
                                  f"print('RESULT ' + json.dumps(hook.{call}))"))

    def listing(self):
        return sorted(os.listdir(self.purelib))


def require_vllm_env():
    if (VLLM_ENV / "bin" / "python").exists() and (VLLM_ENV / ".biv100-env-ok").exists():
        return
    message = f"the vLLM 0.6.3 env is missing at {VLLM_ENV}: build it with .ci/make_vllm_env.sh 0.6.3 {VLLM_ENV}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def hook_venv(tmp_path_factory):
    require_vllm_env()
    venv = HookVenv(tmp_path_factory.mktemp("hook-venv"))
    venv.state.mkdir(mode=0o700)
    subprocess.run([str(VLLM_ENV / "bin" / "python"), "-m", "venv", "--without-pip", str(venv.root / "venv")],
                   check=True, env=clean_env())
    venv.purelib = result_of(run_python(venv.python, "import sysconfig; print('RESULT \"%s\"' % "
                                        "sysconfig.get_paths()['purelib'])"))
    vllm_purelib = result_of(run_python(VLLM_ENV / "bin" / "python", "import sysconfig, json; print('RESULT ' + "
                                        "json.dumps(sysconfig.get_paths()['purelib']))"))
    with open(os.path.join(venv.purelib, "_biv100_test_vllm_env.pth"), "w") as bridge:
        bridge.write(vllm_purelib + "\n")  # torch, vLLM and pip without a reinstall
    source = venv.root / "source"  # a copy: the build's egg-info and build/ stay out of the checkout
    source.mkdir()
    for name in PACKAGE_FILES:
        origin = REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif origin.exists():
            shutil.copy(origin, source / name)
    installed = subprocess.run([str(venv.python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                "--no-input", "--disable-pip-version-check", str(source)],
                               capture_output=True, text=True, env=clean_env(), cwd=str(venv.root))
    assert installed.returncode == 0, installed.stderr
    venv.before_hook = venv.listing()
    venv.hook("install('pth')")
    return venv


SCENARIO = textwrap.dedent("""\
    import json, multiprocessing, sys

    def report():
        import vllm._custom_ops as ops
        from biv100_patch.patches import _startup
        return {"ours": [hasattr(ops.paged_attention_v1, "biv100_patch"), hasattr(ops.paged_attention_v2, "biv100_patch")],
                "handed_off": _startup.handed_off, "hook_failure": _startup.failure}

    def child(queue):
        queue.put(report())

    if __name__ == "__main__":
        mode = sys.argv[1]
        if mode == "raising-apply":
            import biv100_patch.patches.apply as implementation
            def apply(*args, **kwargs):
                raise RuntimeError("injected apply failure")
            implementation.apply = apply
        result = report()
        import biv100_patch.patches as patches
        result["state"] = patches.state()
        if mode == "patched":
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            process = context.Process(target=child, args=(queue,))
            process.start()
            result["spawn_child"] = queue.get(timeout=600)
            process.join(60)
            from importlib.metadata import entry_points
            result["entry_points"] = [[ep.name, ep.value] for ep in entry_points(group="vllm.general_plugins")]
        print("RESULT " + json.dumps(result, default=str))
    """)


@pytest.fixture(scope="session")
def vllm_scenarios(hook_venv):
    """Each scenario in its own interpreter, run side by side (each imports real vLLM: ~10 s of CPU)."""
    script = hook_venv.root / "scenario.py"
    script.write_text(SCENARIO)
    broken_state = hook_venv.root / "broken-state"
    broken_state.mkdir(mode=0o700)
    (broken_state / "probe-cpu.json").write_text('{"format": "biv100-patch-probe", "decision": ')  # cut short
    scenarios = {
        "patched": {},
        "patch-0": {"BIV100_PATCH": "0"},
        "broken-record": {"BIV100_PATCH_HOME": str(broken_state)},
        "raising-apply": {},
    }

    def run(name):
        return subprocess.run([str(hook_venv.python), str(script), name], capture_output=True, text=True,
                              timeout=900, env=hook_venv.env(**scenarios[name]), cwd=str(hook_venv.root))

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(scenarios, pool.map(run, scenarios)))


@pytest.mark.slow
def test_an_interpreter_that_imports_nothing_loads_nothing_heavy(hook_venv):
    code = ("import json, sys; print('RESULT ' + json.dumps([sorted(sys.modules), "
            "[type(f).__name__ for f in sys.meta_path]]))")
    for flags in ((), ("-I",)):
        modules, finders = result_of(hook_venv.run(code, *flags))
        assert "CustomOpsFinder" in finders, flags
        assert [name for name in modules if name.split(".")[0] in HEAVY_MODULES] == [], flags
        assert {"biv100_patch", "biv100_patch.patches", "biv100_patch.patches._startup"} <= set(modules)
        assert "biv100_patch.patches.apply" not in modules and "biv100_patch.probe" not in modules
    modules, finders = result_of(hook_venv.run(code, "-S"))
    assert "CustomOpsFinder" not in finders and "biv100_patch" not in modules  # -S: no site, no hook


@pytest.mark.slow
@pytest.mark.parametrize("environ, expected", [
    ({"BIV100_PATCH": "0"}, False), ({"BIV100_PATCH_BACKEND": "off"}, False), ({"BIV100_PATCH": "no"}, False),
    ({"BIV100_PATCH": "1"}, True), ({"BIV100_PATCH": "maybe"}, True), ({"BIV100_PATCH_BACKEND": "torch"}, True),
])
def test_the_off_switch_keeps_the_finder_out(hook_venv, environ, expected):
    code = ("import sys; print('RESULT ' + str(int(any(type(f).__name__ == 'CustomOpsFinder' "
            "for f in sys.meta_path))))")
    assert result_of(hook_venv.run(code, **environ)) == int(expected)


@pytest.mark.slow
def test_vllm_sees_our_ops_in_the_process_and_in_a_spawn_child(vllm_scenarios):
    result = result_of(vllm_scenarios["patched"])
    assert result["ours"] == [True, True] and result["handed_off"] is True and result["hook_failure"] is None
    assert result["state"]["status"] == "patched", result["state"]
    assert result["spawn_child"] == {"ours": [True, True], "handed_off": True, "hook_failure": None}


@pytest.mark.slow
def test_the_entry_point_is_found_the_way_vllm_looks_it_up(vllm_scenarios, hook_venv):
    result = result_of(vllm_scenarios["patched"])
    assert ["biv100_patch", "biv100_patch.patches.plugin:register"] in result["entry_points"]
    loaded = result_of(hook_venv.run(
        "from importlib.metadata import entry_points; "
        "[register] = [ep.load() for ep in entry_points(group='vllm.general_plugins') if ep.name == 'biv100_patch']; "
        "print('RESULT ' + str(int(callable(register))))"))
    assert loaded == 1


@pytest.mark.slow
def test_biv100_patch_0_leaves_vllm_alone(vllm_scenarios):
    result = result_of(vllm_scenarios["patch-0"])
    assert result["ours"] == [False, False] and result["handed_off"] is False
    assert result["state"]["status"] in ("idle", "skipped"), result["state"]


@pytest.mark.slow
def test_a_broken_record_still_lets_vllm_import(vllm_scenarios):
    completed = vllm_scenarios["broken-record"]
    result = result_of(completed)
    assert result["handed_off"] is True and result["hook_failure"] is None
    assert "Traceback" not in completed.stderr, completed.stderr[-4000:]


@pytest.mark.slow
def test_a_raising_apply_still_lets_vllm_import_unpatched(vllm_scenarios):
    completed = vllm_scenarios["raising-apply"]
    result = result_of(completed)
    assert result["ours"] == [False, False]
    assert completed.stderr.count("injected apply failure") == 1, completed.stderr[-4000:]
    assert "Traceback" not in completed.stderr


@pytest.mark.slow
def test_sitecustomize_mechanism_in_the_venv_and_a_clean_remove(hook_venv):
    report = hook_venv.hook("install('sitecustomize')")
    sitecustomize = os.path.join(hook_venv.purelib, "sitecustomize.py")
    assert report["installed"] == [{"mechanism": "sitecustomize", "path": sitecustomize, "line": 2}]
    assert report["problems"] == []
    modules, finders = result_of(hook_venv.run(
        "import json, sys; print('RESULT ' + json.dumps([sorted(sys.modules), [type(f).__name__ for f in sys.meta_path]]))"))
    assert "biv100_patch.sitecustomize" in modules and finders.count("CustomOpsFinder") == 1
    removed = hook_venv.hook("remove()")
    assert removed == [sitecustomize]
    assert hook_venv.listing() == hook_venv.before_hook  # no sitecustomize.py, no __pycache__ entry
    assert not os.path.exists(os.path.join(hook_venv.purelib, "__pycache__", "sitecustomize.cpython-311.pyc"))
    hook_venv.hook("install('pth')")
    assert hook_venv.hook("status()")["installed"] == [
        {"mechanism": "pth", "path": os.path.join(hook_venv.purelib, hook.PTH_NAME)}]


@pytest.mark.slow
def test_uninstalled_package_with_the_pth_left_behind_harms_nothing(hook_venv, vllm_scenarios):
    """Last: it uninstalls the package from the session's venv."""
    hook_venv.hook("install('pth')")
    uninstall = subprocess.run([str(hook_venv.python), "-m", "pip", "uninstall", "-y", "-q", "biv100-patch"],
                               capture_output=True, text=True, env=clean_env(), cwd=str(hook_venv.root))
    assert uninstall.returncode == 0, uninstall.stderr
    assert hook.PTH_NAME in hook_venv.listing()
    bare = hook_venv.run("print('RESULT 1')")
    assert result_of(bare) == 1 and bare.stderr == ""
    with_vllm = hook_venv.run("import vllm._custom_ops as ops; print('RESULT ' + str(int(callable(ops.paged_attention_v1))))")
    assert result_of(with_vllm) == 1
    assert "biv100_patch_hook" not in with_vllm.stderr and "Error processing line" not in with_vllm.stderr
