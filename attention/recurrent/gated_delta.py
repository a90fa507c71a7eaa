"""A gated-delta (Gated DeltaNet) layer's core over the step's sequences and their state slots:
the causal convolution, then the delta rule, each sequence's state read from its slot and
written back (``forward``); the projections around it are the model's.

Kernels, chosen once per run (``GatedDeltaKernels``): on a GPU our Triton kernels
(``triton_kernels.py``), with a chunked kernel for the prefill tokens where one is installed
(its chunked form beats a token-by-token scan on long prompts): FlashInfer's on Hopper where the
layer's shape allows (key and value heads of 128, bf16 or fp16: 2-3.6x flash-linear-attention's
there, ``benchmarks/gdn_kernels.py --prefill``), else flash-linear-attention's; on a CPU the
torch reference (``reference.py``), which is also the oracle the others are checked against
(tests, ``pagedgen verify``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from pagedgen.attention.metadata import AttentionMetadata
from pagedgen.attention.recurrent import reference
from pagedgen.attention.recurrent.state import GatedDeltaSpec, LayerState

HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_FLA = importlib.util.find_spec("fla") is not None
HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
KERNELS = ("torch", "triton", "fla", "flashinfer")  # the last two: triton, their prefill
DECODE_LAUNCH = (32, 1)  # gated_delta_kernel's value block and warps (benchmarks/gdn_kernels.py)
# conv_kernel's (tokens, channels) a program and its warps, for every step: the fastest measured
# at a decode step of 256 sequences and at a 16,384-token prefill chunk (benchmarks/gdn_kernels.py
# --conv; benchmarks/results/LOG.md)
CONV_TILE = (4, 512)
CONV_WARPS = 8


@dataclass(frozen=True)
class GatedDeltaKernels:
    """Which kernels run: ``scan`` "torch" (the reference) or "triton" (ours, every token);
    ``prefill`` "flashinfer" or "fla" (that library's chunked kernel for prefill tokens) or
    the same as ``scan``."""

    scan: str
    prefill: str

    @classmethod
    def for_device(cls, device: torch.device, asked: str | None = None,
                   specs: tuple[GatedDeltaSpec, ...] = (), dtype: torch.dtype | None = None
                   ) -> GatedDeltaKernels:
        """The fastest that run on ``device`` for layers of ``specs`` in ``dtype`` (``asked``:
        one of ``KERNELS``; "fla" and "flashinfer": our scan with that prefill)."""
        if asked is not None:
            if asked not in KERNELS:
                raise ValueError(f"unknown gated-delta kernels '{asked}' ({', '.join(KERNELS)})")
            if asked in ("fla", "flashinfer"):
                why = chunked_unavailable(asked, device, specs, dtype)
                if why:
                    raise ValueError(f"'{asked}' cannot run here: {why}")
                return cls("triton", asked)
            return cls(asked, asked)
        if device.type != "cuda" or not HAVE_TRITON:
            return cls("torch", "torch")
        for prefill in ("flashinfer", "fla"):
            if not chunked_unavailable(prefill, device, specs, dtype):
                return cls("triton", prefill)
        return cls("triton", "triton")

    def describe(self) -> str:
        return self.scan if self.prefill == self.scan else f"{self.scan}, {self.prefill} prefill"


def chunked_unavailable(library: str, device: torch.device,
                        specs: tuple[GatedDeltaSpec, ...] = (),
                        dtype: torch.dtype | None = None) -> str | None:
    """Why ``library``'s chunked prefill ("fla" or "flashinfer") cannot run layers of ``specs``
    in ``dtype`` on ``device``; None where it can."""
    if device.type != "cuda":
        return "it needs a CUDA GPU"
    if library == "fla":
        return None if HAVE_FLA else "flash-linear-attention (fla) is not installed"
    if not HAVE_FLASHINFER:
        return "FlashInfer is not installed"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "FlashInfer's gated-delta prefill is used on Hopper (sm90) only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashInfer's gated-delta prefill takes bf16 or fp16, not {dtype}"
    odd = [s for s in specs if (s.head_k, s.head_v) != (128, 128)]
    if odd:
        return (f"FlashInfer's gated-delta prefill takes heads of 128, not "
                f"{odd[0].head_k} (keys) and {odd[0].head_v} (values)")
    try:
        from flashinfer.gdn_kernels import chunk_gated_delta_rule_sm90
    except ImportError as e:
        return f"flashinfer.gdn_kernels does not import ({e})"
    if chunk_gated_delta_rule_sm90 is None:  # its CuTe DSL kernel did not import
        return "FlashInfer's sm90 gated-delta prefill kernel is unavailable (CuTe DSL)"
    return None


class GatedDeltaImpl:
    """One gated-delta layer's core: ``forward(qkv, a, b, ...)`` → o [T, Hv, Dv]."""

    def __init__(self, spec: GatedDeltaSpec, kernels: GatedDeltaKernels,
                 batch_invariant: bool = False) -> None:
        self.spec = spec
        self.kernels = kernels
        # the torch reference a token at a time (``reference.token_by_token``): on a CPU a
        # value's bits follow its place in a tensor, so every token is a tensor of its own
        self.batch_invariant = batch_invariant

    def forward(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                a_log: torch.Tensor, dt_bias: torch.Tensor, state: LayerState,
                md: AttentionMetadata) -> torch.Tensor:
        """qkv [T, C] (the projection, before the convolution), a and b [T, Hv] (the gates'
        projections, same row stride), conv_weight [C, K]: the step's output [T, Hv, Dv]."""
        s = self.spec
        if self.kernels.scan == "torch":
            slots, has, _ = md.recurrent_inputs()
            slots, has, lens = slots.tolist(), has.tolist(), md.query_lens_cpu
            if self.batch_invariant:
                return reference.token_by_token(qkv, a, b, conv_weight, conv_bias, a_log,
                                                dt_bias, state.conv, state.ssm, slots, lens,
                                                has, s.num_k_heads, s.head_k, s.head_v)
            mixed = reference.causal_conv(qkv, conv_weight, conv_bias, state.conv, slots, lens,
                                          has)
            out = reference.gated_delta(mixed, a, b, a_log, dt_bias, state.ssm, slots, lens,
                                        has, s.num_k_heads, s.head_k, s.head_v)
            return out
        mixed = conv_triton(qkv, conv_weight, conv_bias, state.conv, md)
        out = torch.empty(qkv.shape[0], s.num_v_heads, s.head_v, dtype=qkv.dtype,
                          device=qkv.device)
        first = 0  # sequences from here run the Triton scan
        if self.kernels.prefill in ("fla", "flashinfer") and md.num_prefills:
            first = md.num_prefills
            self._prefill_chunked(mixed, a, b, a_log, dt_bias, state, md, out)
        if first < md.num_seqs:
            scan_triton(mixed, a, b, a_log, dt_bias, state.ssm, md, s, out, first)
        return out

    def _prefill_chunked(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         a_log: torch.Tensor, dt_bias: torch.Tensor, state: LayerState,
                         md: AttentionMetadata, out: torch.Tensor) -> None:
        """The prefill sequences' tokens through a library's chunked kernel, from their slots'
        states (zero for new sequences) and back into them."""
        s, p, n = self.spec, md.num_prefills, md.num_prefill_tokens
        slots, has, _ = md.recurrent_inputs()
        slots = slots[:p].long()
        key = s.num_k_heads * s.head_k
        qk = qk_norm_triton(mixed[:n], s.num_k_heads, s.head_k)
        v = mixed[:n, 2 * key:].reshape(n, s.num_v_heads, s.head_v)
        g, beta = reference.gates(a[:n], b[:n], a_log, dt_bias)
        h0 = state.ssm[slots].float() * has[:p, None, None, None]  # [p, Hv, Dv, Dk]
        cu = md.query_start_loc[:p + 1].long()  # FlashInfer's split path takes int64 only
        if self.kernels.prefill == "flashinfer":
            from flashinfer.gdn_prefill import chunk_gated_delta_rule

            # its states are laid out as ours; decay as exp(g); outputs straight into ``out``
            _, ht = chunk_gated_delta_rule(
                qk[0], qk[1], v.contiguous(), g=g.exp(), beta=beta, initial_state=h0,
                output_final_state=True, cu_seqlens=cu, output=out[:n])
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            cu_cpu = torch.tensor([0] + md.query_lens_cpu[:p]).cumsum(0)
            o, ht = chunk_gated_delta_rule(  # its states are [N, H, Dk, Dv]
                qk[0, None], qk[1, None], v[None], g=g[None], beta=beta.to(v.dtype)[None],
                initial_state=h0.mT.contiguous(), output_final_state=True, cu_seqlens=cu,
                cu_seqlens_cpu=cu_cpu)
            out[:n] = o[0]
            ht = ht.mT
        state.ssm.index_copy_(0, slots, ht.to(state.ssm.dtype))


def conv_triton(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """``reference.causal_conv`` in Triton: the outputs (and the new windows of one-token
    sequences, every decode), then the prefills' new windows."""
    from pagedgen.attention.recurrent import triton_kernels as tk

    slots, has, token_seq = md.recurrent_inputs()
    t, c = qkv.shape
    taps = weight.shape[1]
    out = torch.empty(t, c, dtype=qkv.dtype, device=qkv.device)
    tokens, block = CONV_TILE
    if t:
        tk.conv_kernel[(-(-t // tokens), -(-c // block))](
            qkv, qkv.stride(0), weight, bias if bias is not None else weight, conv, slots, has,
            token_seq, md.query_start_loc, out, out.stride(0), c, t, K=taps,
            HAS_BIAS=bias is not None, BT=tokens, BC=block, num_warps=CONV_WARPS)
    if md.num_prefills:  # decodes follow the prefills: their windows are written above
        kp = max(2, 1 << (taps - 2).bit_length())
        tk.conv_state_kernel[(md.num_prefills, -(-c // 64))](
            qkv, qkv.stride(0), conv, slots, has, md.query_start_loc, c, K=taps, KP=kp, BC=64)
    return out


def _block(width: int) -> int:
    """A kernel block over ``width`` values: the next power of two, at least 16."""
    return max(16, 1 << (width - 1).bit_length())


def qk_norm_triton(mixed: torch.Tensor, num_k_heads: int, head_k: int) -> torch.Tensor:
    """The q and k heads at the start of each row of ``mixed`` [T, C], L2-normalized
    (``reference.l2_normalize``): [2 (q, k), T, Hk, Dk], contiguous, in ``mixed``'s dtype."""
    from pagedgen.attention.recurrent import triton_kernels as tk

    t = mixed.shape[0]
    out = torch.empty(2, t, num_k_heads, head_k, dtype=mixed.dtype, device=mixed.device)
    rows = 16
    if t:
        tk.qk_norm_kernel[(-(-t * 2 * num_k_heads // rows),)](
            mixed, mixed.stride(0), out, t, num_k_heads, D=head_k,
            BD=_block(head_k), BR=rows)
    return out


def scan_triton(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                dt_bias: torch.Tensor, ssm: torch.Tensor, md: AttentionMetadata,
                spec: GatedDeltaSpec, out: torch.Tensor, first: int = 0) -> None:
    """The delta rule over sequences ``first:`` of the step (every token of each, in order),
    by ``triton_kernels.gated_delta_kernel``, into ``out`` [T, Hv, Dv]."""
    from pagedgen.attention.recurrent import triton_kernels as tk

    slots, has, _ = md.recurrent_inputs()
    n = md.num_seqs - first
    bk = _block(spec.head_k)
    bv = min(DECODE_LAUNCH[0], _block(spec.head_v))
    grid = (-(-spec.head_v // bv), spec.num_v_heads, n)
    tk.gated_delta_kernel[grid](
        mixed, mixed.stride(0), a, b, a.stride(0), a_log, dt_bias, ssm, slots[first:],
        has[first:], md.query_start_loc[first:], out, out.stride(0), spec.num_k_heads,
        spec.num_v_heads, spec.head_k ** -0.5, DK=spec.head_k, DV=spec.head_v, BK=bk, BV=bv,
        num_warps=DECODE_LAUNCH[1])
