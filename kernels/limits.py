"""What a device allows a Triton kernel: the figures the config choice is made from.

Read from the device itself (torch's properties, then Triton's driver), never from its name.
The probe may narrow them (``with_shared_memory_limit``), e.g. to the BI-V100's 48 KB budget.
"""

import dataclasses

# Used only where neither torch nor Triton's driver reports a figure.
DEFAULT_SHARED_MEMORY = 48 * 1024
DEFAULT_WARP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """``capability`` is (major, minor); ``warp_size`` threads per warp (64 on Iluvatar CoreX)."""

    shared_memory_per_block: int
    multiprocessor_count: int
    warp_size: int
    capability: tuple

    def with_shared_memory_limit(self, limit):
        """The same limits with at most ``limit`` bytes of shared memory per block."""
        if limit is None:
            return self
        return dataclasses.replace(self, shared_memory_per_block=min(int(limit), self.shared_memory_per_block))

    @classmethod
    def from_torch_device(cls, device):
        """Measure a CUDA-like ``torch.device`` (or index)."""
        import torch

        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        driver = _triton_driver_properties(index)
        warp_size = driver.get("warpSize") or driver.get("warp_size") or getattr(props, "warp_size", None)
        if not warp_size:
            warp_size = 64 if getattr(torch.version, "hip", None) else DEFAULT_WARP_SIZE
        shared = (driver.get("max_shared_mem")
                  or getattr(props, "shared_memory_per_block_optin", None)
                  or getattr(props, "shared_memory_per_block", None)
                  or DEFAULT_SHARED_MEMORY)
        return cls(shared_memory_per_block=int(shared),
                   multiprocessor_count=int(props.multi_processor_count or driver.get("multiprocessor_count") or 1),
                   warp_size=int(warp_size),
                   capability=(int(props.major), int(props.minor)))


def _triton_driver_properties(index):
    """Triton's own view of the device (its driver reports the warp size on vendor builds); {} if unavailable."""
    try:
        from triton.runtime import driver

        active = getattr(driver, "active", driver)
        return dict(active.utils.get_device_properties(index))
    except Exception:  # an absent or broken Triton must not stop the measurement
        return {}
