"""Host-to-device copies that never make the host wait.

``tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) host memory is not asynchronous:
CUDA synchronises the stream before it copies, so the host waits for every kernel queued before
it. The engine queues a batch while the device still runs the previous one; one such copy per
pass would make it wait for the previous batch instead. ``to_device`` stages through pinned
memory (PyTorch's caching host allocator keeps the block until the copy has run).
"""

from __future__ import annotations

from .lazy_torch import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied asynchronously (no copy when it is there already)."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
