"""The ``biv100-patch`` command: probe the device, apply the patch, inspect and verify it."""

import click

from . import __version__
from .patch_commands import apply_command, remove_command, status_command, verify_command
from .probe_command import probe_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="biv100-patch")
def main():
    """Make vLLM's paged-attention decode work, fast, on Iluvatar BI-V100 and other CUDA-like GPUs.

    Run `biv100-patch probe`, then `biv100-patch apply`, then vLLM as usual.
    """


main.add_command(probe_command)
main.add_command(apply_command)
main.add_command(status_command)
main.add_command(remove_command)
main.add_command(verify_command)
