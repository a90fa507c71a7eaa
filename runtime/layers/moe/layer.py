"""The mixture-of-experts layer: a router (softmax top-k, renormalized or not, as the family
says) and the experts' SwiGLU MLPs in two grouped GEMMs (``moe/kernels.py``; tiles per token
count by measurement, ``moe/plan.py``; torch's grouped GEMM, ``moe/grouped_mm.py``, for the
prefill-sized counts where it measures faster, in bf16 or FP8; MXFP4 experts written out dense a
run at a time for such counts, ``moe/dequantized.py``).

``bias`` (gpt-oss): the router and every expert projection have biases; ``act`` gives the
experts' activation (gpt-oss clamps its SwiGLU).

Under ``-tp`` each rank holds every expert's share of the intermediate features (gate/up rows,
down columns), as a dense MLP shards; the router is replicated, and the layer's output is
all-reduced. Checkpoints name experts one by one (``experts.{e}.gate_proj.weight``, or
Mixtral's ``experts.{e}.w1.weight``), or stacked as transformers 5 holds them
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); ``FusedMoE`` loads
either (``load_checkpoint_tensor``) and names the ones missing (``checkpoint_units``).

The experts' weight format is a ``MoeMethod`` (``runtime/quantization``), chosen as a linear
layer's method is (``QuantConfig.moe_method_for``): dense in the model's dtype, or a format's
(FP8: e4m3 with scales the kernels multiply without dequantizing; MXFP4: 4-bit codes). The
layer keeps the stacking, the tensor-parallel split and the checkpoint's names; the method
keeps the storage and the loading of each expert tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedgen.profiling import scope
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment, load_segment, split
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.linear import ColumnParallelLinear
from pagedgen.runtime.layers.moe import dequantized as moe_dequantized
from pagedgen.runtime.layers.moe import grouped_mm as moe_grouped_mm
from pagedgen.runtime.layers.moe import kernels as mk
from pagedgen.runtime.layers.moe import route as moe_route
from pagedgen.runtime.layers.moe.combine import add_gated
from pagedgen.runtime.layers.moe.plan import INVARIANT, MoePlan, plan_moe
from pagedgen.runtime.quantization.base import MoeMethod
from pagedgen.runtime.quantization.mxfp4.moe import PER_BYTE
from pagedgen.runtime.quantization.unquantized import Unquantized, UnquantizedMoe

GATE, UP, DOWN = "gate", "up", "down"
HF_NAMES = {GATE: "gate_proj", UP: "up_proj", DOWN: "down_proj"}
MIXTRAL_NAMES = {GATE: "w1", UP: "w3", DOWN: "w2"}


def expected_active_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """How many distinct experts ``tokens`` tokens choose on average under uniform routing (a
    token's ``top_k`` are distinct: each expert is missed by it with chance 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP: ``w13_weight`` [E, 2 * I_rank, H] (this rank's gate rows,
    then its up rows), ``w2_weight`` [E, H, I_rank], kept as ``method`` says (None: dense).
    ``names``: the checkpoint's per-expert tensor names. ``use_triton``: the grouped GEMM
    kernels (None: on CUDA tensors), else the per-expert loop. ``act`` (``mk.swiglu``, or
    gpt-oss's ``moe_act.clamped_swiglu``) and ``bias`` (``w13_bias`` [E, 2I_rank], ``w2_bias``
    [E, H], added by one rank): in the grouped GEMM kernels, the first one writing gate and
    up, the biases and activation between them (not torch's grouped GEMM path). Under
    expert parallel (``tp.expert_parallel``) E is this rank's share of whole experts."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 tp: TensorParallel, names: dict[str, str] = HF_NAMES,
                 method: MoeMethod | None = None, act=mk.swiglu, bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.names = num_experts, top_k, names
        self.hidden, self.intermediate = hidden, intermediate  # every expert's, unsharded
        # expert parallel: experts [first, first + local) whole; else a share of every one
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"{num_experts} experts cannot be split over {tp.size} "
                                 "expert-parallel ranks")
            seg = Segment(None, intermediate, 0, intermediate, 0)
            self.local = num_experts // tp.size
        else:
            seg = split(intermediate, tp, "moe_intermediate_size")
            self.local = num_experts
        self.first = tp.rank * self.local if self.expert_parallel else 0
        self.method = method or UnquantizedMoe()
        self.method.create_weights(self, self.local, hidden, seg.size)
        self.act = act
        self.w13_bias = self.w2_bias = None
        gate_up = [Segment(GATE, intermediate, seg.start, seg.size, 0),
                   Segment(UP, intermediate, seg.start, seg.size, seg.size)]
        self.shards = {"w13_weight": (1, gate_up), "w2_weight": (2, [seg])}
        if bias:  # gate/up's rows of this rank; down's whole
            self.w13_bias = nn.Parameter(torch.zeros(self.local, 2 * seg.size),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(self.local, hidden), requires_grad=False)
            self.shards["w13_bias"] = (1, gate_up)
        # the ranks' outputs are summed: a down bias once (each expert lives on one rank)
        self.adds_down_bias = tp.rank == 0 or self.expert_parallel
        self.use_triton: bool | None = None
        self.act_dtype = torch.get_default_dtype()  # the model's (built under it)
        self._plan: MoePlan | None = None
        # --batch-invariant: one tile for every token count on a GPU, a token at a time on a
        # CPU, so a token's sums follow none of the other tokens its experts get
        self.batch_invariant = False

    def plan_kernels(self) -> None:
        """Choose the grouped GEMMs' tiles at load, before the first step (shipped for this
        GPU, cached on this machine, or timed now): a run's steps time nothing."""
        if self.w13_weight.is_cuda and self.use_triton is not False and mk.HAVE_TRITON:
            self._plan = plan_moe(self.w13_weight, self.w2_weight, self.top_k,
                                  self.method.scales(self), self.act_dtype, self.act,
                                  self.w13_bias, self._down_bias)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                out: torch.Tensor | None = None,
                gated: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[T, H]: each token's experts' outputs weighted and summed (into ``out``);
        ``gated`` (a shared expert's output [T, H] and gate logit [T, 1]): plus
        ``sigmoid(logit) * output``, added in the same kernel (``moe_sum.slot_sum``)."""
        triton = self.use_triton if self.use_triton is not None else x.is_cuda
        plain = self.act is mk.swiglu and self.w13_bias is None
        scales = self.method.scales(self)
        b2 = self._down_bias
        if self.expert_parallel:  # others' experts: weight 0, sorted past ours and skipped
            local = ids - self.first
            mine = (local >= 0) & (local < self.local)
            weights = weights * mine
            ids = torch.where(mine, local, 0 if not triton else self.local).to(ids.dtype)
        with scope("moe"):
            if not triton:
                w13, w2 = self.method.dense(self, x.dtype)
                y = mk.reference(x, w13, w2, weights, ids, self.act, self.w13_bias, b2,
                                 rowwise=self.batch_invariant)
                y = y if out is None else out.copy_(y)
                return y if gated is None else add_gated(y, *gated,
                                                         rowwise=self.batch_invariant)
            if not mk.HAVE_TRITON:
                raise RuntimeError("MoE layers on a GPU need Triton (pip install triton)")
            if self.batch_invariant:
                return mk.fused_experts(x, self.w13_weight, self.w2_weight, weights, ids,
                                        (INVARIANT, INVARIANT), out, scales, False, self.act,
                                        self.w13_bias, b2, dropped=self.expert_parallel,
                                        gated=gated)
            if self._plan is None:
                self._plan = plan_moe(self.w13_weight, self.w2_weight, self.top_k, scales,
                                      x.dtype, self.act, self.w13_bias, b2)
            if plain and not self.expert_parallel and self._plan.uses_grouped_mm(x.shape[0]):
                return moe_grouped_mm.experts(x, self.w13_weight, self.w2_weight, weights, ids,
                                              out, fused_ops.silu_and_mul_fused, scales,
                                              gated=gated)
            dense = self._plan.dequantizes(x.shape[0])  # MXFP4 prefill chunks
            if dense is not None:
                return moe_dequantized.experts(x, self.w13_weight, self.w2_weight, weights, ids,
                                               dense, out, scales, self.act, self.w13_bias, b2,
                                               dropped=self.expert_parallel, gated=gated)
            return mk.fused_experts(x, self.w13_weight, self.w2_weight, weights, ids,
                                    self._plan.choose(x.shape[0]), out, scales,
                                    self._plan.native(x.shape[0]), self.act,
                                    self.w13_bias, b2, dropped=self.expert_parallel,
                                    gated=gated)

    @property
    def _down_bias(self) -> torch.Tensor | None:
        """The down bias this rank adds (ranks' outputs are summed: one adds it)."""
        return self.w2_bias if self.adds_down_bias else None

    @property
    def expert_numel(self) -> int:
        """One expert's weights on this rank (gate, up and down)."""
        return self.w13_weight[0].numel() + self.w2_weight[0].numel()

    @property
    def expert_values(self) -> int:
        """One expert's weight values on this rank (MXFP4's uint8 packs ``PER_BYTE`` a byte)."""
        return self.expert_numel * (PER_BYTE if self.w13_weight.dtype == torch.uint8 else 1)

    def expected_expert_bytes(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` tokens reads from this layer's experts under
        uniform routing: the expected number of distinct experts chosen, each read whole."""
        return expected_active_experts(self.num_experts, self.top_k, tokens) \
            * self.local / self.num_experts * self.expert_numel * self.w13_weight.element_size()

    # ---- checkpoint tensors (weights.load_checkpoint calls these for names under us) ----

    def checkpoint_units(self) -> dict[Any, str]:
        """Each tensor this layer needs → its checkpoint name after our prefix."""
        units = {(e, part, kind): f"{e}.{name}.{kind}"
                 for e in range(self.first, self.first + self.local)
                 for part, name in self.names.items()
                 for kind in ("weight", *self.method.extra_kinds())}
        if self.w13_bias is not None:
            units.update({name: name for name in self.BIASES})
        return units

    BIASES = {"gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}  # stacked

    def load_checkpoint_tensor(self, rest: str, tensor) -> list[Any]:
        """Load the checkpoint tensor named ``rest`` after our prefix; the units it filled.
        KeyError: not one of ours; ValueError: a shape that does not fit."""
        if rest in ("gate_up_proj", "down_proj"):  # stacked: [E, 2I, H] or [E, H, I]
            return self._load_stacked(rest, tensor)
        base, _, kind = rest.rpartition("_")
        if base in ("gate_up_proj", "down_proj") and kind in self.method.extra_kinds():
            return self._load_stacked(base, tensor, kind)  # the method's, stacked alike
        if rest in self.BIASES and self.w13_bias is not None:  # [E, 2I] (gate, up) or [E, H]
            name, whole = self.BIASES[rest], tensor[:]
            param, shard = getattr(self, name).data, self.shards.get(name)
            full = [self.num_experts, param.shape[1] if shard is None else 2 * self.intermediate]
            if list(whole.shape) != full:
                raise ValueError(f"has shape {list(whole.shape)}; the config makes it {full}")
            whole = whole[self.first:self.first + self.local]  # this rank's experts
            if shard is None:
                param.copy_(whole)
            else:  # this rank's gate rows, then its up rows
                for s, part in zip(shard[1], whole.chunk(2, dim=1)):
                    load_segment(param, shard, s.key, part)
            return [rest]
        e, _, name = rest.partition(".")
        module, _, kind = name.rpartition(".")
        part = next((p for p, n in self.names.items() if module == n), None)
        if not e.isdigit() or int(e) >= self.num_experts or part is None:
            raise KeyError(rest)
        if kind in ("weight", *self.method.extra_kinds()):
            if not self.first <= int(e) < self.first + self.local:
                return []  # another expert-parallel rank's
            self._load_expert(int(e), part, tensor, kind)
            return [(int(e), part, kind)]
        if kind in self.method.skipped_kinds():
            return []
        raise KeyError(rest)

    def _load_expert(self, e: int, part: str, tensor, kind: str = "weight") -> None:
        """Expert ``e``'s checkpoint tensor ``part`` (its ``kind``: weight, or a tensor of
        the method's) into its slice of our stacked parameters, as a sharded linear layer's
        parameter is loaded (only this rank's rows or columns)."""
        dim, segs = self.shards["w2_weight" if part == DOWN else "w13_weight"]
        self.method.load(self, e - self.first, part, kind, tensor, (dim - 1, segs),  # one's dims
                         None if part == DOWN else part)

    DRAWN = ("w13_weight", "w2_weight")  # what dummy weights draw dense (``load_drawn``)

    def drawn_shape(self, name: str) -> torch.Size:
        """The unsharded dense shape of ``name`` (``w13_weight`` or ``w2_weight``) that dummy
        weights draw, whatever form the method stores it in."""
        if name == "w2_weight":
            return torch.Size([self.num_experts, self.hidden, self.intermediate])
        return torch.Size([self.num_experts, 2 * self.intermediate, self.hidden])

    def load_drawn(self, name: str, full: torch.Tensor) -> None:
        """Dummy weights: the unsharded ``full`` tensor drawn for parameter ``name``
        (``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I]) through the checkpoint path, so
        quantized experts are stored as a checkpoint's would be."""
        self._load_stacked("down_proj" if name == "w2_weight" else "gate_up_proj", full)

    def _load_stacked(self, rest: str, tensor, kind: str = "weight") -> list[Any]:
        whole, full = tensor[:], self.intermediate
        if rest == "down_proj":
            parts = [(DOWN, whole)]
        else:
            if whole.dim() != 3 or whole.shape[1] != 2 * full:
                raise ValueError(f"has shape {list(whole.shape)}; the config makes it "
                                 f"{[self.num_experts, 2 * full, *whole.shape[2:]]}")
            parts = [(GATE, whole[:, :full]), (UP, whole[:, full:])]
        if whole.shape[0] != self.num_experts:
            raise ValueError(f"holds {whole.shape[0]} experts; the config makes it "
                             f"{self.num_experts}")
        mine = range(self.first, self.first + self.local)
        for part, t in parts:
            for e in mine:
                self._load_expert(e, part, t[e], kind)
        return [(e, p, kind) for p, _ in parts for e in mine]


class SparseMoeBlock(nn.Module):
    """Router (``gate``: [E, H], replicated on every rank) and ``experts``; the output summed
    over the tensor-parallel ranks (by the RMSNorm after it when ``defer_reduce``)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int,
                 renormalize: bool, tp: TensorParallel, names: dict[str, str] = HF_NAMES,
                 method: MoeMethod | None = None, act=mk.swiglu, bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the "
                             f"number of experts ({num_experts})")
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        self.gate = ColumnParallelLinear(hidden, [(None, Segment(None, num_experts, 0,
                                                                 num_experts, 0))],
                                         bias, Unquantized())
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, tp, names, method,
                                act, bias)
        self.defer_reduce = False  # True: partial sums, reduced by the RMSNorm after it

    def takes_quantized_input(self, m: int) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route.route(self.gate(x), self.top_k, self.renormalize)

        partial = self.tp.partial_output(x.shape[0], x.shape[1], x.dtype,
                                         lambda out: self.experts(x, weights, ids, out))
        return partial if self.defer_reduce else self.tp.reduce_partial(partial)
