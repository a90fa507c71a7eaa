"""Host → device uploads that do not wait for the GPU."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``. On CUDA the copy goes through pinned memory and is
    non-blocking: a copy from pageable memory would wait for every kernel already queued, which
    would undo async scheduling."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU ``tensor`` on ``device``, through pinned memory and non-blocking as ``to_device``."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
