"""``biv100-patch apply | status | remove | verify``: the patch and its import hook from the shell.

Nothing heavy at module level: ``status`` and ``remove`` never import torch or vLLM.
"""

import json
import sys

import click

BACKEND_CHOICE = click.Choice(["auto", "triton", "torch", "off"])


def _would_patch():
    """Which vLLM this interpreter would patch, from its distribution metadata (vLLM not imported)."""
    from biv100_patch.patches import families
    raw = families.installed_version()
    family, _, reason = families.version_verdict(raw)
    return {"vllm_version": raw, "family": family.name if family else None, "reason": reason,
            "note": "the signatures are checked again when vllm._custom_ops is imported" if family else None}


def _describe_vllm(would):
    if would["vllm_version"] is None:
        return "vLLM      not installed here (the hook patches it once it is)"
    return f"vLLM      {would['vllm_version']}: {would['reason']}"


def _hook_error(error):
    click.echo(f"Error: {error}", err=True)
    sys.exit(2)


@click.command("apply")
@click.option("--backend", type=BACKEND_CHOICE, default="auto", show_default=True,
              help="auto: the probe's decision (BIV100_PATCH_BACKEND still overrides it).")
@click.option("--refresh", is_flag=True, help="Probe again even if a stored record fits.")
@click.option("--sitecustomize", is_flag=True,
              help="Install the hook as one line in sitecustomize.py instead of a .pth file.")
@click.option("--json", "as_json", is_flag=True, help="Print the decision and the hook's state as JSON.")
def apply_command(backend, refresh, sitecustomize, as_json):
    """Probe (or reuse the record), install the import hook, print the decision.

    From then on every Python process of this interpreter that imports vLLM gets the patch.
    Exit codes: 0 done, 2 bad setting or the hook cannot be installed, 3 the probe could not run.
    """
    from biv100_patch import probe
    from biv100_patch.patches import hook

    try:
        record = probe.get_decision(refresh=refresh, backend_override=None if backend == "auto" else backend,
                                    progress=not as_json)
    except (probe.SettingsError, probe.OverrideRefused, ValueError) as error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(2)
    except Exception as error:
        click.echo(f"Error: the probe could not run: {type(error).__name__}: {error}", err=True)
        sys.exit(3)
    try:
        hook_state = hook.install("sitecustomize" if sitecustomize else "pth")
    except hook.HookError as error:
        _hook_error(error)
    decision = record.get("decision") or {}
    would = _would_patch()
    if as_json:
        click.echo(json.dumps({"decision": decision, "hook": hook_state, "vllm": would}, indent=1, default=str))
        return
    click.echo(f"decision  {decision.get('backend')}: {decision.get('reason')}")
    click.echo("\n".join(hook.describe(hook_state)))
    click.echo(_describe_vllm(would))


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def status_command(as_json):
    """Show the decision record, the import hook's state and which vLLM would be patched."""
    from biv100_patch import probe
    from biv100_patch.patches import hook

    try:
        record = probe.load_decision()
    except Exception as error:  # status must answer even with a broken record
        record = {"error": f"{type(error).__name__}: {error}"}
    hook_state = hook.status()
    would = _would_patch()
    if as_json:
        click.echo(json.dumps({"record": record, "hook": hook_state, "vllm": would}, indent=1, default=str))
        return
    if record is None:
        click.echo("record    none yet (run `biv100-patch probe` or `biv100-patch apply`)")
    elif "error" in record and "decision" not in record:
        click.echo(f"record    unreadable: {record['error']}")
    else:
        from biv100_patch.probe_command import summary
        click.echo(summary(record))
    click.echo("\n".join(hook.describe(hook_state)))
    click.echo(_describe_vllm(would))


@click.command("remove")
def remove_command():
    """Take the import hook out again (every file or line of ours)."""
    from biv100_patch.patches import hook

    try:
        changed = hook.remove()
    except hook.HookError as error:
        _hook_error(error)
    if changed:
        for path in changed:
            click.echo(f"removed   {path}")
    else:
        click.echo("nothing to remove: the import hook is not installed")


@click.command("verify")
@click.option("--backend", type=BACKEND_CHOICE, default="auto", show_default=True)
@click.option("--device", default=None, help="torch device [default: cuda if available, else cpu].")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default=None,
              help="[default: float16 on a GPU, float32 on the CPU]")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON at the end.")
def verify_command(backend, device, dtype, as_json):
    """Run the installed vLLM's own PagedAttention.forward_decode (its v1 and v2 paths) through the
    patch on this device and compare with a float64 reference. Exit code 1 on any failure."""
    from biv100_patch.patches.verify import verify

    report = verify(backend=backend, device=device, dtype=dtype, echo=click.echo)
    if as_json:
        click.echo(json.dumps(report, indent=1, default=str))
    sys.exit(0 if report["ok"] else 1)
