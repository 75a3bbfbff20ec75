"""``biv100-patch probe``: detect the device, test Triton there, and show or print the decision record.

Imports nothing heavy at module level: a probe that reuses its record must answer, interpreter
start included, in well under a second.
"""

import json
import sys

import click

EXIT_OK, EXIT_AOT_FAILED, EXIT_USAGE, EXIT_PROBE_ERROR = 0, 1, 2, 3
# Opt-in shared memory per block by compute capability (NVIDIA's tables), the BI-V100's 48 KB for 7.x.
SHARED_MEMORY_DEFAULTS = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}
SHARED_MEMORY_7X = 48 * 1024
VERSION_ORDER = ("python", "torch", "triton", "vllm", "biv100-patch")


class Capability(click.ParamType):
    """``X.Y``, e.g. 7.0 or 9.0."""

    name = "X.Y"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        major, dot, minor = str(value).strip().partition(".")
        if not (dot and major.isdigit() and minor.isdigit() and 1 <= int(major) <= 20 and int(minor) <= 9):
            self.fail(f"{value!r} is not a compute capability; use MAJOR.MINOR such as 7.0 or 9.0", param, ctx)
        return int(major), int(minor)


def default_shared_memory(capability):
    if capability[0] == 7:
        return SHARED_MEMORY_7X
    return SHARED_MEMORY_DEFAULTS.get(capability)


HELP = """Detect the device, check that Triton compiles and runs correct kernels on it, and decide
which backend the patch uses (triton, torch or off). The decision is kept in a record that later
runs reuse while the device, driver and versions stay the same.

\b
With --target-capability no GPU is needed: every Triton kernel variant is compiled ahead of time
for that capability and judged against --shared-memory-limit.

\b
Exit codes:
  0  a decision was made (any backend), or every AOT variant compiled and fits
  1  --target-capability: at least one variant failed to compile or does not fit
     (or no kernel config fits the limit at all)
  2  bad usage: an unknown option value, a bad environment setting, a refused override
  3  the probe itself could not run (an unexpected error; the message says which)
"""


@click.command("probe", help=HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON instead of a summary.")
@click.option("--refresh", is_flag=True, help="Probe again even if a stored record fits.")
@click.option("--bench", is_flag=True, help="Also time both backends (Triton must not be slower).")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=None, metavar="SECONDS",
              help="Seconds the probe's child may go without progress (a step or kernel variant done) "
                   "before it is killed as hung [default: BIV100_PATCH_PROBE_TIMEOUT or 180].")
@click.option("--device", type=click.IntRange(min=0), default=None, metavar="INDEX",
              help="Which device to probe [default: the current one].")
@click.option("--target-capability", type=Capability(), default=None,
              help="Compile every Triton variant ahead of time for this capability (no GPU needed).")
@click.option("--shared-memory-limit", type=click.IntRange(min=1024, max=1 << 20), default=None, metavar="BYTES",
              help="With --target-capability: shared memory per block allowed [default: 49152 for 7.x].")
@click.pass_context
def probe_command(ctx, as_json, refresh, bench, timeout, device, target_capability, shared_memory_limit):
    if target_capability is None:
        if shared_memory_limit is not None:
            raise click.BadOptionUsage("--shared-memory-limit", "--shared-memory-limit needs --target-capability")
        ctx.exit(_probe(as_json, refresh, bench, timeout, device))
    for name, given in (("--refresh", refresh), ("--bench", bench), ("--device", device is not None)):
        if given:
            raise click.BadOptionUsage(name, f"{name} probes a device; it cannot be used with --target-capability")
    if shared_memory_limit is None:
        shared_memory_limit = default_shared_memory(target_capability)
        if shared_memory_limit is None:
            raise click.BadOptionUsage(
                "--shared-memory-limit",
                f"no default shared-memory limit for capability {target_capability[0]}.{target_capability[1]}; "
                "pass --shared-memory-limit BYTES")
    ctx.exit(_aot(as_json, target_capability, shared_memory_limit))


def _probe(as_json, refresh, bench, timeout, device):
    from biv100_patch import probe

    try:
        found = probe.get_decision(refresh=refresh, timeout=timeout, bench=bench, device=device, progress=True)
    except (probe.SettingsError, probe.OverrideRefused, ValueError) as error:
        click.echo(f"Error: {error}", err=True)
        return EXIT_USAGE
    except Exception as error:  # report, with the exit code the help promises
        click.echo(f"Error: the probe could not run: {type(error).__name__}: {error}", err=True)
        return EXIT_PROBE_ERROR
    if as_json:
        click.echo(json.dumps(found, indent=1, sort_keys=True))
    else:
        click.echo(summary(found))
    return EXIT_OK


def _size(value, unit=1024, suffixes=("B", "KB", "MB", "GB")):
    if value is None:
        return "?"
    for suffix in suffixes:
        if value < unit or suffix == suffixes[-1]:
            return f"{value:.1f} {suffix}" if suffix != "B" else f"{value} B"
        value /= unit
    return str(value)


def summary(found):
    """The human summary: device, versions, each check with ✓/✗ and seconds, decision and reason."""
    from biv100_patch.probe.record import summary_line

    device, storage = found.get("device") or {}, found.get("storage") or {}
    lines = []
    how = "record reused" if storage.get("reused") else "probed now"
    lines.append(f"biv100-patch probe ({how}, {found.get('created', '?')})")
    capability = device.get("capability")
    parts = [device.get("name") or "unknown device"]
    if capability:
        parts.append(f"capability {capability[0]}.{capability[1]}")
    if device.get("multiprocessor_count"):
        parts.append(f"{device['multiprocessor_count']} SMs")
    if device.get("warp_size"):
        parts.append(f"warp {device['warp_size']}")
    if device.get("shared_memory_per_block"):
        parts.append(f"{_size(device['shared_memory_per_block'])} shared/block")
    if device.get("total_memory"):
        parts.append(_size(device["total_memory"]))
    lines.append(f"device    {' · '.join(parts)}")
    lines.append(f"vendor    {device.get('vendor', '?')} ({'; '.join(device.get('vendor_signals') or []) or 'no signal'})")
    driver = {key: value for key, value in (device.get("driver") or {}).items() if value}
    if driver:
        lines.append(f"driver    {', '.join(f'{key} {value}' for key, value in driver.items())}")
    found_versions = found.get("versions") or {}
    lines.append("versions  " + " · ".join(f"{name} {(found_versions.get(name) or {}).get('version') or 'missing'}"
                                            for name in VERSION_ORDER if name in found_versions))
    if found.get("checks"):
        lines.append("checks")
        for entry in found["checks"]:
            mark = {"passed": "✓", "skipped": "–"}.get(entry["status"], "✗")
            error = f"  {summary_line(entry['error'])}" if entry.get("error") and entry["status"] != "skipped" else ""
            lines.append(f"  {mark} {entry['step']} {entry['title']:<42} {entry['seconds']:7.2f} s{error}")
    decision = found.get("decision") or {}
    lines.append(f"decision  {decision.get('backend')}: {decision.get('reason')}")
    for key in decision.get("excluded_variants") or []:
        _, head_pad, _, block_size, dtype, kv_cache_dtype, block_n, rows, warps, stages, use_dot, prefetch = key
        lines.append(f"excluded  head sizes padded to {head_pad}, block {block_size}, {dtype}, cache {kv_cache_dtype} "
                     f"({rows} query rows, {block_n}-token steps, {warps} warps, {stages} stages, "
                     f"{'tl.dot' if use_dot else 'broadcast'}, {'prefetch' if prefetch else 'pipelined'}): "
                     "such calls use the PyTorch backend")
    where = storage.get("path")
    if where:
        kept = "kept" if storage.get("written") or storage.get("reused") else "NOT kept"
        lines.append(f"record    {where} ({kept})")
    for problem in storage.get("problems") or []:
        lines.append(f"note      {problem}")
    if found.get("runtime_events"):
        lines.append(f"events    {len(found['runtime_events'])} runtime event(s); see --json")
    return "\n".join(lines)


def _aot(as_json, capability, shared_memory_limit):
    from biv100_patch.probe import versions
    from biv100_patch.probe.record import summary_line

    try:
        from biv100_patch.kernels import variants
    except Exception as error:
        click.echo(f"Error: the Triton kernels cannot be loaded: {type(error).__name__}: {error}", err=True)
        return EXIT_PROBE_ERROR

    def progress(done, total, *_):
        click.echo(f"aot: compiled {done}/{total}", err=True)

    try:
        entries = variants.compile_variants(capability, shared_memory_limit, progress=progress)
    except ValueError as error:  # the kernels have no config at all under this limit: a finding
        click.echo(f"AOT for capability {capability[0]}.{capability[1]}: {error}", err=True)
        return EXIT_AOT_FAILED
    except Exception as error:
        click.echo(f"Error: ahead-of-time compilation could not run: {type(error).__name__}: {error}", err=True)
        return EXIT_PROBE_ERROR
    report = []
    for entry in entries:
        item = dict(entry)
        fits = item.get("shared_bytes") is not None and item["shared_bytes"] <= shared_memory_limit
        item["ok"] = bool(item.get("ok")) and fits
        if item.get("ok") is False and not item.get("error") and not fits:
            item["error"] = f"needs {item.get('shared_bytes')} bytes of shared memory, over {shared_memory_limit}"
        report.append(item)
    failed = [item for item in report if not item["ok"]]

    document = {"target": {"capability": f"{capability[0]}.{capability[1]}",
                           "shared_memory_limit": shared_memory_limit},
                "versions": versions.collect(), "aot": report,
                "summary": {"variants": len(report), "ok": len(report) - len(failed), "failed": len(failed)}}
    if as_json:
        click.echo(json.dumps(document, indent=1, sort_keys=True, default=str))
    else:
        click.echo(f"AOT for capability {capability[0]}.{capability[1]}, {shared_memory_limit} bytes of shared "
                   f"memory per block: {len(report) - len(failed)} of {len(report)} variants ok")
        for item in report:
            mark = "✓" if item["ok"] else "✗"
            tail = f"  {summary_line(item.get('error'))}" if not item["ok"] and item.get("error") else ""
            click.echo(f"  {mark} {item.get('kernel')} head {item.get('head_size'):>3} block {item.get('block_size'):>2} "
                       f"{item.get('dtype'):<8} {item.get('kv_cache_dtype'):<8} {item.get('shared_bytes')} B{tail}")
    sys.stdout.flush()
    return EXIT_AOT_FAILED if failed else EXIT_OK
