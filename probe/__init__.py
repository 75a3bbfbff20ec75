"""The probe: what the device is, whether Triton really works there, and the decision it leads to.

The API the rest of biv100-patch uses:

- ``get_decision(refresh=False, backend_override=None, timeout=None, bench=False, device=None)``:
  the record (a dict) for the device, probing when no stored record fits;
  ``record["decision"]["backend"]`` is ``triton``, ``torch`` or ``off``.
- ``load_decision(device=None)``: the stored record or None; read-only, a few milliseconds.
- ``add_runtime_event(kind_or_event, message=None, device=None, details=None)`` (also called
  ``record_runtime_event``): note a runtime fallback; never raises.
- ``record_path(device=None)`` and ``settings.state_dir()``: where the record lives.
"""

from .decide import (OverrideRefused, ProbeError, add_runtime_event, get_decision, load_decision,
                     record_path, record_runtime_event)
from .record import BACKENDS
from .settings import SettingsError

__all__ = ["BACKENDS", "OverrideRefused", "ProbeError", "SettingsError", "add_runtime_event", "get_decision",
           "load_decision", "record_path", "record_runtime_event"]
