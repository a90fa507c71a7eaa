"""Host → device uploads that do not wait for the GPU.

On CUDA the copy goes through pinned memory and is non-blocking: a copy from pageable memory
would wait for every kernel already queued, which would undo async scheduling.
"""

from __future__ import annotations

import torch


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a CPU tensor, pinned when it is bound for a CUDA ``device`` (so that the
    host can read it, e.g. to inspect block tables, before ``upload``)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A ``host_tensor`` on ``device`` (non-blocking from pinned memory)."""
    return tensor.to(device, non_blocking=tensor.is_pinned())


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``."""
    return upload(host_tensor(values, dtype, device), device)


def upload_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor made elsewhere (an image's patches) on ``device``: pinned first on CUDA,
    then ``upload``."""
    if device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return upload(tensor, device)
