"""Shared pieces of the benchmarks: where results go, the environment, timers, the copy ceiling, output files.

Every benchmark writes into ``benchmarks/results/<gpu-name-slug>/`` (``cpu`` without a GPU): a JSON file with
every number and the environment, a markdown table and a PNG plot. Timers follow the team's method: on CUDA
``triton.testing.do_bench`` (median, L2 flushed before each repetition); on the CPU a plain median over calls.
torch, triton, matplotlib and tqdm are imported only when needed, so ``--help`` stays instant.
"""

import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"


def slug(text):
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: lower case, runs of other characters become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_name(device):
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def results_dir(root, device):
    """``root/<gpu-name-slug>/``, created."""
    path = pathlib.Path(root) / slug(device_name(device))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_version(module_name):
    try:
        module = __import__(module_name)
    except Exception as error:  # noqa: BLE001 - a broken install is reported, not raised
        return f"unavailable ({type(error).__name__})"
    return getattr(module, "__version__", "unknown")


def _git_commit():
    """The tree's commit: ``BIV100_BENCH_COMMIT`` where the sender of a copied tree knows it better than the
    copy's git metadata, else ``git rev-parse`` (with ``+changes`` when tracked files differ from it)."""
    if os.environ.get("BIV100_BENCH_COMMIT"):
        return os.environ["BIV100_BENCH_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    if not commit:
        return None
    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return commit
    return commit + "+changes" if changed else commit


def environment(device):
    """What the numbers were measured on: device, versions, date (UTC), commit."""
    import torch

    info = {
        "device": str(device),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(capability=list(torch.cuda.get_device_capability(device)),
                    multiprocessor_count=props.multi_processor_count,
                    total_memory_bytes=props.total_memory)
    else:
        info.update(cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return info


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_us(fn, device, warmup_ms, rep_ms):
    """Median time of ``fn()`` in microseconds.

    CUDA: ``triton.testing.do_bench`` (its warm-up and repetition budgets are milliseconds; it flushes the
    L2 before each timed call). CPU: a warm-up call, then calls until ``rep_ms`` has passed (at least 3).
    """
    if device.type == "cuda":
        import triton.testing

        return 1000.0 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000.0
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def interleaved_samples(calls, measure, rounds, warmup_rounds=1):
    """``{name: [measure(fn), ...]}`` for each of ``calls`` (name -> fn), over ``warmup_rounds + rounds`` rounds
    that alternate the calls' order (reversed, then as given, ...), so that no call always goes first; the
    warm-up rounds' samples are dropped."""
    samples = {name: [] for name in calls}
    order = list(calls.items())
    for round_index in range(warmup_rounds + rounds):
        for name, fn in (order if round_index % 2 else order[::-1]):
            sample = measure(fn)
            if round_index >= warmup_rounds:
                samples[name].append(sample)
    return samples


def few_calls_us(fn, device, calls):
    """Median of ``calls`` synchronised calls in microseconds, for calls too slow for ``bench_us``."""
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


HOST_ROUND_CALLS = 200  # calls per timed round: up to 3 kernels each stay under CUDA's ~1024 pending launches


def host_call_us(fn, device, calls, rounds=5):
    """Host-side cost of one ``fn()`` call in microseconds: the Python call alone, no device wait.

    ``calls`` calls are timed on the CPU clock in rounds of at most ``HOST_ROUND_CALLS``, the device
    synchronised between rounds outside the timer: once CUDA's launch queue is full a launch waits for
    the GPU, and the timer would measure the kernels instead. Repeated ``rounds`` times; returns the
    median per-call time.
    """
    for _ in range(min(20, calls)):
        fn()
    synchronize(device)
    per_call = []
    for _ in range(rounds):
        elapsed, left = 0.0, calls
        while left > 0:
            batch = min(left, HOST_ROUND_CALLS)
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            elapsed += time.perf_counter() - start
            synchronize(device)
            left -= batch
        per_call.append(elapsed / calls)
    return 1e6 * statistics.median(per_call)


def copy_ceiling(device, nbytes, warmup_ms, rep_ms):
    """A ``nbytes`` device-to-device copy: time and bandwidth counting bytes read plus bytes written."""
    import torch

    elements = nbytes // 4
    source = torch.rand(elements, device=device)
    target = torch.empty_like(source)
    us = bench_us(lambda: target.copy_(source), device, warmup_ms, rep_ms)
    del source, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    moved = 2 * elements * 4
    return {"bytes_copied": elements * 4, "bytes_moved": moved, "us": us, "gbps": moved / us / 1e3}


class Progress:
    """A tqdm bar on stderr when tqdm is importable, else one ``[i/n] label`` line per step."""

    def __init__(self, total, description):
        self.total = total
        self.count = 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            print(f"{description}: {total} steps", file=sys.stderr, flush=True)
        else:
            # Off a terminal (a log, a remote run) redraw rarely: each redraw is a line in the log.
            interactive = sys.stderr.isatty()
            self.bar = tqdm(total=total, desc=description, file=sys.stderr, dynamic_ncols=True,
                            mininterval=0.1 if interactive else 15.0)

    def step(self, label):
        self.count += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.count}/{self.total}] {label}", file=sys.stderr, flush=True)

    def write(self, message):
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def write_json(path, payload):
    """Write ``payload`` atomically (a partial run leaves the last complete file, never half a file)."""
    path = pathlib.Path(path)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(temporary, path)


def markdown_table(header, rows):
    """A GitHub markdown table; ``None`` cells print as an en dash."""
    def cell(value):
        return "–" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_panels(path, panels, ceiling, xlabel, ylabel, title, ceiling_label):
    """One log-x subplot per panel, one line per series, ``ceiling`` drawn as a horizontal line.

    ``panels``: ``{panel title: {series name: [(x, y), ...]}}``; points are drawn in x order.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, max(1, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4.2 * rows), squeeze=False, sharey=True)
    markers = "osD^v<>ph*"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(name for series in panels.values() for name in series))  # same style everywhere
    for axis, (panel_title, series) in zip(axes.flat, panels.items()):
        for name, points in series.items():
            points = sorted(p for p in points if p[1] is not None)
            index = names.index(name)
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker=markers[index % len(markers)],
                          color=colors[index % len(colors)], markersize=4, linewidth=1.2, label=name)
        if ceiling:
            axis.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=ceiling_label)
        axis.set_xscale("log")
        axis.set_title(panel_title, fontsize=10)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
