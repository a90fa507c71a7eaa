"""A MoE block with a shared expert beside the routed ones (Qwen2-MoE's ``shared_expert``, the
form Qwen3.5-MoE and DeepSeek use): every token also goes through one SwiGLU MLP, scaled by a
sigmoid gate (``shared_expert_gate``: one logit a token), and added to the routed experts'
output. Under ``-tp`` the shared MLP is sharded as a dense one; its partial sums are added to
the routed experts' in their buffer and reduced once, with them."""

from __future__ import annotations

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment
from pagedgen.runtime.layers import fused_ops, moe_route
from pagedgen.runtime.layers.linear import ColumnParallelLinear
from pagedgen.runtime.layers.moe import SparseMoeBlock
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
        self.fused = False  # ``use_fused_kernels``: the gated add in one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with scope("shared_expert"):
            shared = self.shared_expert.partial_sums(x)
            logit = self.shared_expert_gate(x)
        weights, ids = moe_route.route(self.gate(x), self.top_k, self.renormalize)
        partial = self.tp.partial_output(x.shape[0], x.shape[1], x.dtype,
                                         lambda out: self.experts(x, weights, ids, out))
        (fused_ops.gated_add_fused if self.fused else fused_ops.gated_add_ref)(
            partial, shared, logit)
        return partial if self.defer_reduce else self.tp.reduce_partial(partial)
