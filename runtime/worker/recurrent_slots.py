"""The recurrent state of a model's linear-attention layers, sized and bound at start-up: a slot
for each of ``max_num_seqs`` sequences (and the scratch slot CUDA-graph padding writes), in the
run's memory plan before the KV cache takes what is left.

Each slot holds every linear-attention layer's state (``attention/recurrent/state.py``). When
the slots would take more than half the memory free after the weights, ``max_num_seqs`` is
lowered to what fits (the summary says so); the KV cache then sizes itself from what the
memory profile finds left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedgen import envs
from pagedgen.attention.recurrent.gated_delta import GatedDeltaImpl, GatedDeltaKernels
from pagedgen.attention.recurrent.state import GatedDeltaSpec, RecurrentStates
from pagedgen.errors import PagedgenError
from pagedgen.runtime import hardware

SHARE_OF_FREE = 0.5  # the most of the memory left after the weights that slots may take


@dataclass
class RecurrentSlots:
    states: RecurrentStates
    kernels: GatedDeltaKernels
    max_num_seqs: int  # the run's max_num_seqs (maybe lowered)
    lowered_from: int | None = None  # the max_num_seqs asked for, when it did not fit

    @property
    def scratch_slot(self) -> int:
        return self.states.scratch_slot

    def summary(self) -> dict[str, object]:
        per = RecurrentStates.bytes_per_slot(self.states.specs, self.states.dtype)
        out: dict[str, object] = {
            "linear_attention_layers": len(self.states.specs),
            "linear_attention_kernels": self.kernels.describe(),
            "recurrent_state_slots": self.states.num_slots,
            "recurrent_state_bytes": self.states.nbytes,
            "recurrent_state_bytes_per_slot": per}
        if self.lowered_from is not None:
            out["max_num_seqs_lowered"] = (f"{self.lowered_from:,} → {self.max_num_seqs:,}: a "
                                           f"sequence's linear-attention state takes "
                                           f"{per / 2**20:.1f} MiB")
        return out


def bind_recurrent(model, specs: list[GatedDeltaSpec], max_num_seqs: int, dtype: torch.dtype,
                   device: torch.device, batch_invariant: bool = False) -> RecurrentSlots:
    """Allocate ``max_num_seqs`` + 1 slots (fewer where they do not fit) and bind each
    linear-attention layer's core and state into ``model``. ``batch_invariant``: every token
    through the scan (no chunked prefill: a prompt's sums would follow its chunks), the
    delta-rule state in float32 (a state rounded between steps would round where a prompt
    is cut), a token at a time on a CPU (``GatedDeltaImpl``)."""
    if batch_invariant:
        specs = [dataclasses.replace(s, ssm_dtype=torch.float32) for s in specs]
    per_slot = RecurrentStates.bytes_per_slot(specs, dtype)
    free = hardware.available_memory(device)
    lowered = None
    if free is not None and (max_num_seqs + 1) * per_slot > free * SHARE_OF_FREE:
        fit = int(free * SHARE_OF_FREE) // per_slot - 1
        if fit < 1:
            raise PagedgenError(
                f"one sequence's linear-attention state takes {per_slot / 2**20:.1f} MiB and "
                f"{device} has {free / 2**30:.2f} GiB free beside the weights: free memory or "
                "choose a smaller model")
        max_num_seqs, lowered = fit, max_num_seqs
    try:
        kernels = GatedDeltaKernels.for_device(device, envs.GATED_DELTA.get(), tuple(specs),
                                               dtype)
    except ValueError as e:
        raise PagedgenError(f"{envs.GATED_DELTA.name}: {e}")
    if batch_invariant:
        kernels = GatedDeltaKernels(kernels.scan, kernels.scan)
    states = RecurrentStates(specs, max_num_seqs + 1, dtype, device)
    model.bind_recurrent([GatedDeltaImpl(s, kernels, batch_invariant) for s in specs],
                         states.layers)
    return RecurrentSlots(states, kernels, max_num_seqs, lowered)
