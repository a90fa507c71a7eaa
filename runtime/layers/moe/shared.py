"""A MoE block with a shared expert beside the routed ones (Qwen2-MoE's ``shared_expert``, the
form Qwen3.5-MoE and DeepSeek use): every token also goes through one SwiGLU MLP, scaled by a
sigmoid gate (``shared_expert_gate``: one logit a token), and added to the routed experts'
output in their sum's kernel. The router, the gate and (unquantized) the shared expert's
gate/up projection read the tokens in one GEMM (``MergedProjections``). Under ``-tp`` the
shared MLP is sharded as a dense one; its partial sums are added to the routed experts' in
their buffer and reduced once, with them."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment
from pagedgen.runtime.layers.linear import ColumnParallelLinear, MergedProjections
from pagedgen.runtime.layers.moe import route as moe_route
from pagedgen.runtime.layers.moe.layer import SparseMoeBlock
from pagedgen.runtime.quantization.unquantized import Unquantized


class SharedExpertMoeBlock(SparseMoeBlock):
    """``SparseMoeBlock`` (``gate``, ``experts``) with ``shared_expert`` (an MLP module with
    ``partial_sums``, made by the family) and ``shared_expert_gate`` ([1, H], replicated, in
    the model's dtype as the router is)."""

    def __init__(self, *args, shared_expert: nn.Module, tp: TensorParallel, **kw) -> None:
        super().__init__(*args, tp=tp, **kw)
        hidden = self.gate.in_features
        self.shared_expert = shared_expert
        self.shared_expert_gate = ColumnParallelLinear(
            hidden, [(None, Segment(None, 1, 0, 1, 0))], False, Unquantized())
        self.merged: MergedProjections | None = None  # ``merge_projections``

    def merge_projections(self) -> None:
        """After loading: the router, the shared expert's gate and (unquantized) its gate/up
        projection as one GEMM over the tokens."""
        gate_up = self.shared_expert.gate_up_proj
        self.merged = MergedProjections.of([self.gate, self.shared_expert_gate, gate_up]) \
            or MergedProjections.of([self.gate, self.shared_expert_gate])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum plus ``sigmoid(logit) * shared``, added in the experts'
        last kernel (``FusedMoE``'s ``gated``)."""
        logits, *merged = self.merged(x) if self.merged is not None else [self.gate(x)]
        with scope("shared_expert"):
            rest = (self.shared_expert_gate, self.shared_expert.gate_up_proj)[len(merged):]
            logit, gate_up = merged + [layer(x) for layer in rest]  # the unmerged: a GEMM each
            shared = self.shared_expert.partial_sums(gate_up)
        weights, ids = moe_route.route(logits, self.top_k, self.renormalize)
        partial = self.tp.partial_output(
            x.shape[0], x.shape[1], x.dtype,
            lambda out: self.experts(x, weights, ids, out, gated=(shared, logit)))
        return partial if self.defer_reduce else self.tp.reduce_partial(partial)
