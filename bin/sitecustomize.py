"""``import biv100_patch.sitecustomize`` in your own sitecustomize.py installs the import hook.

For interpreters whose sitecustomize.py is managed by hand (or by a distribution) instead of a
``.pth`` file: the import puts the lazy ``vllm._custom_ops`` finder on ``sys.meta_path`` and
does nothing else (see ``biv100_patch.patches._startup``). ``biv100-patch apply --sitecustomize``
appends exactly this import, guarded, to the interpreter's sitecustomize.py. Importing it again,
or together with the ``.pth`` hook, changes nothing.
"""

from .patches._startup import install

install()
