"""A workload's lower bound on a GPU, from the model's shapes alone (``peers.py``'s
``roofline_s``): prefill FLOPs at the measured matmul rate; each decode step of an ideal schedule
(every request decoding at once) at max(bytes / measured copy bandwidth, FLOPs / matmul rate).

Layers by kind (``layer_types``; none: every layer full attention): a full-attention layer's
causal attention is quadratic in the context and its decode reads every cached token's K/V; a
sliding-window layer's attends and reads at most its window; a linear-attention (Gated DeltaNet)
layer holds no KV: its projections' matmuls, the delta rule's state product per token (4 FLOPs
per state entry: the output and the update), and in decode its state read and written once (in
bf16, the smallest a system keeps it in). A MoE layer's tokens meet their top-k experts and a
shared expert where the model has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedgen.runtime.layers.moe.layer import expected_active_experts

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def moe_shape(c) -> tuple[int, int, int]:
    """(experts, experts per token, expert width) of each MLP; a dense MLP is (1, 1, width)."""
    if getattr(c, "num_local_experts", 0):
        width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        return c.num_local_experts, c.num_experts_per_tok, width
    return 1, 1, c.intermediate_size


def layer_counts(c) -> dict[str, int]:
    """How many layers of each kind (full, sliding-window, linear attention) the model has."""
    kinds = getattr(c, "layer_types", None) or [FULL] * c.num_hidden_layers
    unknown = set(kinds) - {FULL, SLIDING, LINEAR}
    if unknown:
        raise ValueError(f"layer kinds {sorted(unknown)} have no roofline")
    window = getattr(c, "sliding_window", None)
    counts = {k: kinds.count(k) for k in (FULL, SLIDING, LINEAR)}
    if not window:  # no window given: its layers attend everything
        counts[FULL], counts[SLIDING] = counts[FULL] + counts[SLIDING], 0
    return counts


def kv_bytes_per_token(c) -> int:
    """A token's K and V over every layer that caches them, in bf16."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n = layer_counts(c)
    return 2 * (n[FULL] + n[SLIDING]) * c.num_key_value_heads * head_dim * 2


@dataclass(frozen=True)
class Shapes:
    """A model's per-token matmul weights and attention widths, by layer kind."""

    counts: dict[str, int]
    q_dim: int  # query features of an attention layer
    kv_bytes: int  # one cached token's K/V over the attention layers
    window: int  # a sliding-window layer's keys (0: none)
    attn: int  # an attention layer's projection weights
    linear_attn: int  # a linear-attention layer's projection weights
    state: int  # a linear-attention layer's state entries a sequence holds
    experts: int
    top_k: int
    expert: int  # one routed expert's weights
    shared: int  # the shared expert's weights (0: none)
    head: int  # the LM head's weights

    @classmethod
    def of(cls, c) -> Shapes:
        hidden = c.hidden_size
        head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
        q_dim, kv_dim = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        counts = layer_counts(c)
        gated = counts[LINEAR] > 0  # the hybrid families' q_proj also writes the output gate
        attn = hidden * ((2 if gated else 1) * q_dim + 2 * kv_dim) + q_dim * hidden
        linear_attn = state = 0
        if counts[LINEAR]:
            hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
            dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
            # q, k, v and the output gate z in; a and b per value head; out
            linear_attn = hidden * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * hidden
            state = hv * dk * dv
        experts, top_k, width = moe_shape(c)
        shared = 3 * hidden * (getattr(c, "shared_expert_intermediate_size", 0) or 0)
        return cls(counts, q_dim, kv_bytes_per_token(c),
                   getattr(c, "sliding_window", None) or 0, attn, linear_attn, state, experts,
                   top_k, 3 * hidden * width, shared, hidden * c.vocab_size)

    @property
    def attention_layers(self) -> int:
        return self.counts[FULL] + self.counts[SLIDING]

    def linear(self, routed: float) -> float:
        """Matmul weights a step meets over every layer (no embedding, no head), with
        ``routed`` routed experts in each MLP."""
        n = self.counts
        return (self.attention_layers * self.attn + n[LINEAR] * self.linear_attn
                + sum(n.values()) * (routed * self.expert + self.shared))

    def pairs(self, new: int, before: int) -> float:
        """Query-key pairs of ``new`` causal tokens after ``before`` cached ones, summed over the
        attention layers (a window caps each query's keys)."""
        full = new * before + new * new / 2
        sliding = full
        if self.window:
            w = self.window
            head = max(0, min(new, w - before))  # queries whose keys all fit the window
            sliding = min(full, head * before + head * head / 2 + (new - head) * w)
        return self.counts[FULL] * full + self.counts[SLIDING] * sliding

    def decode_kv_bytes(self, contexts: list[int]) -> float:
        """A decode step's cached K/V bytes over sequences of these contexts."""
        per_layer = self.kv_bytes / max(1, self.attention_layers)
        keys = sum(self.counts[FULL] * n + self.counts[SLIDING] * min(n, self.window or n)
                   for n in contexts)
        return per_layer * keys


def roofline_s(hf_config, prompts: list[list[int]], outs: list[int], flops: float,
               bw: float, shared: int = 0, fp8_flops: float | None = None) -> float:
    """Lower bound on the workload's time on this GPU (the module docstring). With ``shared``,
    every prompt starts with the same ``shared`` tokens, and the ideal reuses them: their
    prefill runs once, and each decode step reads their K/V once for the whole batch. With
    ``fp8_flops``, the linear layers' weights are FP8: one byte each, multiplied at that peak
    (the LM head stays in bf16)."""
    m = Shapes.of(hf_config)
    linear = m.linear(m.top_k)
    linear_bytes = 1 if fp8_flops else 2
    lin_flops = fp8_flops or flops
    attn = 4 * m.q_dim  # FLOPs per query-key pair (QK and PV)
    recur = 4 * m.state * m.counts[LINEAR]  # FLOPs per token of the delta rule
    state_bytes = 2 * 2 * m.state * m.counts[LINEAR]  # a sequence's states, read and written

    def weight_bytes(batch: int) -> float:
        """A decode step's weight bytes: the experts its tokens are expected to choose
        (uniform routing), the LM head (the embedding: only the batch's rows)."""
        chosen = expected_active_experts(m.experts, m.top_k, batch)
        return linear_bytes * m.linear(chosen) + 2 * m.head

    t = (2 * linear * shared / lin_flops
         + (attn * m.pairs(shared, 0) + recur * shared) / flops)
    for p in prompts:  # prefill: linear layers, attention, the delta rule, the last logits
        n = len(p) - shared
        t += 2 * linear * n / lin_flops + (2 * m.head + attn * m.pairs(n, shared)
                                           + recur * n) / flops
    for step in range(1, max(outs)):  # decode: token `step` of every request still running
        ctx = [len(p) + step for p, o in zip(prompts, outs) if o > step]
        kv = m.decode_kv_bytes([n - shared for n in ctx]) + (
            m.decode_kv_bytes([shared]) if shared else 0)
        compute = 2 * len(ctx) * (linear / lin_flops + m.head / flops) + len(ctx) * recur / flops
        t += max((weight_bytes(len(ctx)) + kv + len(ctx) * state_bytes) / bw, compute)
    return t
