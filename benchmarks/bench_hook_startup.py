"""What the import hook costs a Python process that never imports vLLM: ``python -c pass``, hook vs none.

Builds a throwaway venv (no pip, no torch), installs this repository into it as a regular wheel,
then times ``python -c pass`` there in three states, in blocks of 10 starts per state, the states
interleaved round by round in a shuffled order so that machine noise hits all of them alike:

- ``none``: no hook file (the package is installed, nothing imports it),
- ``pth``: ``biv100_patch_hook.pth`` as ``biv100-patch apply`` writes it,
- ``sitecustomize``: the guarded line in a sitecustomize.py (``apply --sitecustomize``).

Reports the median wall time of each, the hook's extra milliseconds (median minus the ``none``
median; the target is under 5 ms), the mean CPU time (user + system, less sensitive to a busy
machine than wall time), and the hook's own work timed inside fresh interpreters (importing
``_startup`` and ``install()``). One ``-X importtime`` run shows which modules the hook loads.

    python benchmarks/bench_hook_startup.py [--runs 300] [--results-dir benchmarks/results]

Writes ``<results-dir>/cpu/hook_startup.json`` and ``.md`` (the hook's cost is a CPU matter).
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import _common

from biv100_patch.patches import hook

TARGET_MS = 5.0
STATES = ("none", "pth", "sitecustomize")
BLOCK = 10  # timed starts per state in a row; states change between blocks, in a shuffled order


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="timed starts per state (default 300)")
    parser.add_argument("--results-dir", default=str(_common.DEFAULT_RESULTS_ROOT),
                        help="files go to RESULTS_DIR/cpu/ (default benchmarks/results)")
    args = parser.parse_args()
    if args.runs < 10:
        parser.error("--runs: at least 10")
    return args


def build_venv(workdir):
    """A venv without pip holding this repository as a regular (not editable) install."""
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    source = workdir / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "bin", "probe", "kernels", "patches"):
        origin = _common.REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif origin.exists():
            shutil.copy(origin, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(workdir / "wheel"), str(source)],
                   check=True, cwd=str(workdir))
    [wheel] = (workdir / "wheel").glob("*.whl")
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    return python, purelib


def set_state(state, purelib):
    hook.remove(purelib)
    if state != "none":
        hook.install(state, purelib)


def start_ms(python, env):
    """Wall and CPU (user + system) milliseconds of one ``python -c pass``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], check=True, env=env)
    wall = 1000.0 * (time.perf_counter() - begin)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, 1000.0 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


HOOK_WORK = ("import time; begin = time.perf_counter(); from biv100_patch.patches._startup import install; "
             "install(); print(1000.0 * (time.perf_counter() - begin))")


def hook_work_ms(python, env, runs):
    """The hook's own work, timed inside fresh interpreters that have no hook file (import + install)."""
    return [float(subprocess.run([str(python), "-c", HOOK_WORK], check=True, capture_output=True, text=True,
                                 env=env).stdout) for _ in range(runs)]


def importtime_lines(python, env):
    """``-X importtime`` lines of the modules the hook brings (self and cumulative microseconds)."""
    completed = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                               env=env, check=True)
    return [line.split(":", 1)[1].strip() for line in completed.stderr.splitlines()
            if "biv100_patch" in line or line.rstrip().endswith("| site")]


def main():
    args = parse_args()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("BIV100_", "PYTHON"))}
    with tempfile.TemporaryDirectory(prefix="biv100-hook-bench-") as workdir:
        python, purelib = build_venv(pathlib.Path(workdir))
        times = {state: [] for state in STATES}
        cpu_times = {state: [] for state in STATES}
        for state in STATES:  # warm the page cache and the bytecode caches of every state
            set_state(state, purelib)
            for _ in range(5):
                start_ms(python, env)
        rounds = -(-args.runs // BLOCK)
        for round_number in range(1, rounds + 1):
            order = list(STATES)
            random.shuffle(order)
            for state in order:
                set_state(state, purelib)
                start_ms(python, env)  # a fresh hook file's bytecode is written once, as after `apply`
                for _ in range(BLOCK):
                    wall, cpu = start_ms(python, env)
                    times[state].append(wall)
                    cpu_times[state].append(cpu)
            if round_number % 10 == 0:
                print(f"[hook startup] {round_number}/{rounds} rounds", file=sys.stderr)
        importtime = {}
        for state in ("pth", "sitecustomize"):
            set_state(state, purelib)
            importtime[state] = importtime_lines(python, env)
        modules = subprocess.run([str(python), "-c", "import sys, json; print(json.dumps(sorted(sys.modules)))"],
                                 capture_output=True, text=True, env=env, check=True).stdout
        set_state("none", purelib)
        hook_work = hook_work_ms(python, env, max(10, args.runs // 3))

    medians = {state: statistics.median(values) for state, values in times.items()}
    extra = {state: medians[state] - medians["none"] for state in ("pth", "sitecustomize")}
    cpu_means = {state: statistics.fmean(values) for state, values in cpu_times.items()}
    cpu_extra = {state: cpu_means[state] - cpu_means["none"] for state in ("pth", "sitecustomize")}
    result = {
        "benchmark": "hook_startup",
        "command": "python -c pass",
        "runs_per_state": len(times["none"]),
        "median_ms": {state: round(value, 3) for state, value in medians.items()},
        "p25_ms": {state: round(statistics.quantiles(values, n=4)[0], 3) for state, values in times.items()},
        "extra_ms": {state: round(value, 3) for state, value in extra.items()},
        "cpu_mean_ms": {state: round(value, 3) for state, value in cpu_means.items()},
        "cpu_extra_ms": {state: round(value, 3) for state, value in cpu_extra.items()},
        "hook_work_median_ms": round(statistics.median(hook_work), 3),
        "hook_work_runs": len(hook_work),
        "target_extra_ms": TARGET_MS,
        "meets_target": all(value < TARGET_MS for value in extra.values()),
        "modules_at_start_with_pth": [name for name in json.loads(modules) if name.startswith("biv100_patch")],
        "importtime_us": importtime,
        "environment": {
            "python": platform.python_version(),
            "executable": sys.executable,
            "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": _common._git_commit(),
            "purelib_scheme": sysconfig.get_default_scheme() if hasattr(sysconfig, "get_default_scheme") else None,
        },
    }
    out = pathlib.Path(args.results_dir) / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hook_startup.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {state} | {medians[state]:.2f} | {result['p25_ms'][state]:.2f} | "
            + ("—" if state == "none" else f"{extra[state]:+.2f}") + f" | {cpu_means[state]:.2f} | "
            + ("—" if state == "none" else f"{cpu_extra[state]:+.2f}") + " |" for state in STATES]
    (out / "hook_startup.md").write_text("\n".join([
        "# Import hook start-up cost (`python -c pass`)",
        "",
        f"{len(times['none'])} starts per state (blocks of {BLOCK}, interleaved), Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"load average at the end {result['environment']['load_average']}, {result['environment']['date']}.",
        "",
        "| hook | wall median ms | wall 25th percentile ms | extra wall ms (median) | CPU mean ms | extra CPU ms |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"The hook's own work (import of `biv100_patch.patches._startup` and `install()`, timed inside "
        f"{len(hook_work)} fresh interpreters): median {result['hook_work_median_ms']:.3f} ms.",
        "",
        f"Target: under {TARGET_MS:g} ms extra: {'met' if result['meets_target'] else 'NOT met'}.",
        "",
        "Modules the hook loads at start (`-X importtime`, self | cumulative microseconds, .pth):",
        "",
        *[f"    {line}" for line in importtime["pth"]],
        "",
    ]))
    print(json.dumps({"median_ms": result["median_ms"], "extra_ms": result["extra_ms"],
                      "cpu_extra_ms": result["cpu_extra_ms"], "hook_work_median_ms": result["hook_work_median_ms"],
                      "meets_target": result["meets_target"]}))


if __name__ == "__main__":
    main()
