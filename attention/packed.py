"""Attention within each of a batch of sequences packed end to end, every token seeing every
token of its own sequence and none of another's: a vision tower's images (``[tokens, heads,
head_dim]``, bounds ``cu_seqlens`` on the host).

``PackedAttention`` runs torch SDPA one sequence at a time without cuDNN's kernel, or (asked,
``$PAGEDGEN_VISION_ATTENTION=fa4``) one FlashAttention-4 varlen call over the whole batch
where FA4 runs on this GPU and takes the head size. On an H100, Qwen3.5's tower (head size 72)
spent a third of its time in torch's FlashAttention-2 kernel (its head size padded to 96,
about 185 TFLOP/s), and cuDNN's, faster once warm, builds an execution plan for every sequence
length it has not met, which is every new image size (``benchmarks/vision_tower.py``). FA4
compiles one kernel for all lengths, at construction, where a call over two sequences longer
than its tiles is held to SDPA's: where it fails or differs, SDPA runs and ``why`` says so.
FA4 becomes the default once measured on a GPU.

Hand-written: transformers' vision attention takes a varlen kernel only through its
flash-attn package names; this is the few lines between FA4's call and torch's.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedgen import envs
from pagedgen.attention.flash_attn.flavours import BY_NAME, flavour_reason
from pagedgen.errors import PagedgenError

# SDPA's kernels for packed sequences: none built per sequence length (cuDNN's is)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CHECK_ERROR = 0.02  # FA4 against SDPA at construction, both in half precision (unit inputs)


def fa4_reason(device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """None where FA4 can run packed attention of this head size and type; otherwise why not."""
    why = flavour_reason(BY_NAME["fa4"], device)
    if why is None and dtype not in (torch.bfloat16, torch.float16):
        why = f"FA4 takes bf16 or fp16, not {dtype}"
    if why is None and (head_dim % 8 or not 8 <= head_dim <= 256):
        why = f"FA4 takes head sizes of 8 to 256 in steps of 8, not {head_dim}"
    if why is None and torch.cuda.get_device_capability(device)[0] != 9 and head_dim > 128:
        why = f"FA4 takes head sizes up to 128 off Hopper, not {head_dim}"
    return why


class PackedAttention:
    """Packed attention on ``device`` for heads of ``head_dim`` in ``dtype``: ``kernel``, "fa4"
    or "sdpa", as asked (else ``$PAGEDGEN_VISION_ATTENTION``, else "sdpa"); ``why``: why FA4,
    asked, does not run (else None); ``sdpa_backends``: SDPA's kernels (None: torch's own
    order, cuDNN's first on Hopper)."""

    def __init__(self, device: torch.device, head_dim: int, dtype: torch.dtype,
                 kernel: str | None = None,
                 sdpa_backends: list[SDPBackend] | None = SDPA_BACKENDS) -> None:
        kernel = kernel or envs.VISION_ATTENTION.get() or "sdpa"
        if kernel not in ("sdpa", "fa4"):
            raise PagedgenError(f"{envs.VISION_ATTENTION.name}={kernel}: expected sdpa or fa4")
        self.why = fa4_reason(device, head_dim, dtype) if kernel == "fa4" else None
        self.kernel = "fa4" if kernel == "fa4" and self.why is None else "sdpa"
        self.sdpa_backends = sdpa_backends
        self.fwd = None
        self._bounds: tuple[torch.Tensor, torch.Tensor, int] | None = None
        if self.kernel == "fa4":
            from pagedgen.attention.fa4_import import import_fa4

            try:  # FA4's kernel compiled now, not in the run, and held to SDPA's output
                self.fwd = import_fa4().interface._flash_attn_fwd
                self._check(device, head_dim, dtype)
            except Exception as e:  # a kernel FA4 cannot build or run here: SDPA's, and why
                self.why = f"FA4 failed here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                self.kernel, self.fwd = "sdpa", None

    def _check(self, device: torch.device, head_dim: int, dtype: torch.dtype) -> None:
        """FA4 over two sequences that span several of its tiles, against SDPA's output."""
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(533, 2, head_dim, generator=g).to(device, dtype)
                   for _ in range(3))
        cu, scale = torch.tensor([0, 200, 533]), head_dim ** -0.5
        err = (self._fa4(q, k, v, cu, scale).float()
               - self._sdpa(q, k, v, cu, scale).float()).abs().max().item()
        if not err <= CHECK_ERROR:
            raise RuntimeError(f"its output differs from SDPA's by up to {err:.3g}")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
        """Each sequence's attention output [tokens, heads, head_dim]; ``cu_seqlens``: int
        bounds on the host (a tower's layers pass the same tensor: uploaded once)."""
        run = self._fa4 if self.kernel == "fa4" else self._sdpa
        return run(q, k, v, cu_seqlens, scale)

    def _sdpa(self, q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        with sdpa_kernel(self.sdpa_backends) if self.sdpa_backends else nullcontext():
            return torch.cat([  # 4-D: SDPA's fused kernels take no other
                F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv),
                                               scale=scale)[0].transpose(0, 1)
                for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))])

    def _fa4(self, q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
        if self._bounds is None or self._bounds[0] is not cu_seqlens:
            self._bounds = (cu_seqlens, cu_seqlens.to(q.device, torch.int32, non_blocking=True),
                            int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        _, cu, longest = self._bounds
        return self.fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu,
                        cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                        softmax_scale=scale, causal=False)[0]
