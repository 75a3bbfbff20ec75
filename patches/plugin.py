"""The ``vllm.general_plugins`` entry point: vLLM (>= 0.5.5) calls ``register()`` in every process
its engine starts (engine core, each worker), before the model runs.

It only calls ``apply()``, which is idempotent (a process the import hook already patched is left
as it is) and handles ``vllm._custom_ops`` being imported or not yet. It never raises: vLLM logs
a failing plugin and goes on, and so do we, once, on the ``biv100_patch`` logger.
"""

import logging


def register():
    try:
        from biv100_patch import patches
        patches.apply()
    except Exception as error:  # apply() itself does not raise; this guards the import
        logging.getLogger("biv100_patch").warning("biv100-patch: the vLLM plugin could not apply the patch "
                                                  "(%s: %s); vLLM runs unpatched", type(error).__name__, error)
