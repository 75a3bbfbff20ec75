"""How fast the probe answers once its record exists (issue 3's speed targets).

1. ``biv100-patch probe`` reusing its record, timed from outside: interpreter start included
   (target: well under 1 s).
2. ``load_decision()`` inside a process that has torch imported (target: under 10 ms), and
   ``get_decision()`` on its reuse path for comparison.

The record is made first in a private temporary state directory (a real probe: on a GPU this
runs the whole ladder once). Writes ``benchmarks/results/<gpu-name-slug or cpu>/probe.json`` and
``probe.md``.

    python benchmarks/bench_probe.py [--runs 10] [--lookups 200] [--results-root DIR]
"""

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402  (benchmarks/_common.py beside this file)

CLI_TARGET_S = 1.0
LOOKUP_TARGET_S = 0.010


def probe_command_line():
    """The installed console script, else the same command through ``python -c``."""
    script = shutil.which("biv100-patch", path=os.path.dirname(sys.executable))
    if script:
        return [script, "probe"], "biv100-patch probe"
    return ([sys.executable, "-c", "from biv100_patch.cli import main; main()", "probe"],
            "python -c 'biv100_patch.cli:main' probe")


def time_cli(command, runs, environment):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return times, done.stdout


def time_lookups(lookups):
    import torch  # noqa: F401 (the measured situation: a process with torch imported)

    from biv100_patch import probe

    results = {}
    for name, function in (("load_decision()", probe.load_decision),
                           ("get_decision() on a reused record", lambda: probe.get_decision(progress=False))):
        function()
        times = []
        for _ in range(lookups):
            start = time.perf_counter()
            found = function()
            times.append(time.perf_counter() - start)
        assert found["storage"]["reused"], "the record was not reused"
        results[name] = times
    return results, found


def summary(times):
    ordered = sorted(times)
    return {"median_s": statistics.median(ordered), "p95_s": ordered[int(0.95 * (len(ordered) - 1))],
            "max_s": ordered[-1], "runs": len(ordered)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="timed CLI runs (default 10)")
    parser.add_argument("--lookups", type=int, default=200, help="timed in-process lookups (default 200)")
    parser.add_argument("--results-root", default=str(_common.DEFAULT_RESULTS_ROOT))
    arguments = parser.parse_args()
    if arguments.runs < 1 or arguments.lookups < 1:
        parser.error("--runs and --lookups must be at least 1")

    state = tempfile.mkdtemp(prefix="biv100-probe-bench-")
    os.environ["BIV100_PATCH_HOME"] = state
    environment = dict(os.environ)
    command, label = probe_command_line()
    print(f"making the record in {state} (a full probe) ...", file=sys.stderr)
    first = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if first.returncode != 0:
        raise SystemExit(f"the first probe failed ({first.returncode}): {first.stderr.strip()}")
    cli_times, cli_output = time_cli(command, arguments.runs, environment)
    lookups, found = time_lookups(arguments.lookups)
    shutil.rmtree(state, ignore_errors=True)

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cli = summary(cli_times)
    lookup_summaries = {name: summary(times) for name, times in lookups.items()}
    payload = {
        "environment": _common.environment(device),
        "decision": found["decision"],
        "cli": dict(cli, command=label, target_s=CLI_TARGET_S, met=cli["max_s"] < CLI_TARGET_S),
        "lookups": {name: dict(values, target_s=LOOKUP_TARGET_S, met=values["median_s"] < LOOKUP_TARGET_S)
                    for name, values in lookup_summaries.items()},
        "cli_output": cli_output,
    }
    directory = _common.results_dir(arguments.results_root, device)
    _common.write_json(directory / "probe.json", payload)
    rows = [[f"`{label}` (record reused, interpreter start included)", f"{cli['median_s'] * 1e3:.0f} ms",
             f"{cli['p95_s'] * 1e3:.0f} ms", f"{cli['max_s'] * 1e3:.0f} ms", f"< {CLI_TARGET_S * 1e3:.0f} ms (max)",
             "yes" if payload["cli"]["met"] else "NO"]]
    for name, values in lookup_summaries.items():
        rows.append([f"`{name}` with torch imported", f"{values['median_s'] * 1e3:.2f} ms",
                     f"{values['p95_s'] * 1e3:.2f} ms", f"{values['max_s'] * 1e3:.2f} ms",
                     f"< {LOOKUP_TARGET_S * 1e3:.0f} ms (median)", "yes" if payload["lookups"][name]["met"] else "NO"])
    table = _common.markdown_table(["what", "median", "p95", "max", "target", "met"], rows)
    environment_line = (f"{payload['environment']['gpu']}, torch {payload['environment']['torch']}, "
                        f"python {payload['environment']['python']}, {payload['environment']['date']}")
    text = (f"# Probe speed\n\n{environment_line}. Decision: **{found['decision']['backend']}** "
            f"({found['decision']['reason']})\n\n{table}\n\n"
            f"{cli['runs']} CLI runs and {arguments.lookups} lookups of each kind on a {os.cpu_count()}-core machine; "
            "the CLI's target is checked on its slowest run, the lookups' on their median.\n")
    (directory / "probe.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
