"""Host values onto a device without making the host wait: used by the engine's decode steps and by the
selections, which index and size by values the host holds."""
from __future__ import annotations

import torch


def upload(values, device: torch.device) -> torch.Tensor:
    """Host values (a list or an array) on ``device`` without waiting for it: from pinned memory, asynchronously
    on CUDA (a copy from pageable memory first waits for the device's queued work)."""
    tensor = torch.as_tensor(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
