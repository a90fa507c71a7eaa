"""What ``profile`` and the benchmarks measure the worker by (``Engine.measurement()``), so that
none of them reads the model runner: the least a decode step must move (weights, KV, the
linear-attention state), the model's GEMM and MoE figures for the rooflines, the decode steps'
KV reads since a mark, the host time of one attention call, and the two switches a
measurement needs (one step without CUDA graphs,
as the reference its graph replays are attributed against; cascade decode off, against on).
Read-only but for those switches, each a context that puts the setting back."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import torch

from pagedgen.runtime.engine.stats import DecodeReads


class Measurement:
    """The figures of ``runner`` (a ``ModelRunner``) a measurement reads; ``peak_held``: the
    most pages its engine held at once (the KV summary's); ``hf_config``: the model's."""

    def __init__(self, runner: Any, peak_held: int, hf_config: Any) -> None:
        self._r = runner
        self._peak_held = peak_held
        self._hf = hf_config

    def figures(self) -> dict[str, Any]:
        """What runs and how: the first KV group's backend (``backend``; the summary's
        ``Engine.describe`` names every group's), device, dtypes, tensor-parallel size and rank,
        weight format, CUDA graphs and fused kernels, the KV cache."""
        r = self._r
        return {"backend": r.backend.name, "cuda_graphs": r.graphs is not None,
                "fused_kernels": r.fused_kernels, "device": str(r.device),
                "dtype": str(r.dtype).removeprefix("torch."),
                "tensor_parallel_size": r.tp.size, "tensor_parallel_rank": r.tp.rank,
                "kv_cache_dtype": str(r.kv_dtype).removeprefix("torch."),
                "quantization": r.quant.describe() if r.quant else None,
                **r.kv.summary(r.num_blocks, self._peak_held)}

    def state_bytes(self) -> int:
        """Bytes of linear-attention state a decode step reads and writes per sequence."""
        rec = self._r.recurrent
        return 0 if rec is None else sum(s.state_bytes_per_token(rec.states.dtype)
                                         for s in rec.states.specs)

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token takes over every layer (this rank's)."""
        return self._r.block_bytes() / self._r.block_size

    def decode_bytes(self, batch: int, context: float) -> dict[str, float]:
        """The least a decode step of ``batch`` sequences of ``context`` tokens reads (this
        rank): the weights it touches (a MoE layer's experts as ``batch`` tokens are expected
        to choose them), the KV, the linear-attention state (read and written)."""
        r = self._r
        return {"weights": r.model.step_weight_bytes(batch),
                "kv": batch * r.kv.read_bytes(context), "state": batch * self.state_bytes()}

    def gemm_figures(self) -> dict[str, Any]:
        """The rooflines' model figures (this rank's): parameters of the linear layers, bytes
        of the FP8 ones (weights and scales), the LM head's parameters, the first attention
        layer's heads and head size and the count of attention layers."""
        r = self._r
        modules = list(r.model.modules())
        hf = self._hf
        return {"linear_params": sum(m.weight.numel() for m in modules
                                     if hasattr(m, "quant_method")),
                "fp8_linear_bytes": sum(m.weight.numel() + 4 * m.weight_scale.numel()
                                        for m in modules if hasattr(m, "weight_scale")),
                "fp8": r.quant is not None,
                "lm_head_params": hf.vocab_size * hf.hidden_size / r.tp.size,
                "num_heads": r.specs[0].num_heads, "head_size": r.specs[0].head_size,
                "attention_layers": len(r.specs)}

    def moe_figures(self, batch: int, tokens: int) -> dict[str, Any] | None:
        """The MoE layers' expert bytes a decode step of ``batch`` tokens is expected to read
        (uniform routing), the FLOPs of ``tokens`` prefill tokens' top-k experts and whether
        the experts are FP8; None for a model without experts."""
        experts = [m for m in self._r.model.modules() if hasattr(m, "expected_expert_bytes")]
        if not experts:
            return None
        return {"decode_bytes": sum(m.expected_expert_bytes(batch) for m in experts),
                "prefill_flops": sum(2 * tokens * m.top_k * m.expert_values for m in experts),
                "fp8": experts[0].w13_weight.dtype == torch.float8_e4m3fn}

    def decode_reads(self) -> DecodeReads:
        """A mark of the decode steps' KV reads so far (``decode_reads_since``)."""
        return copy.copy(self._r.decode_reads)

    def decode_reads_since(self, mark: DecodeReads) -> dict[str, float | int]:
        return self._r.decode_reads.summary(since=mark)

    def host_ms_per_step(self, kind: str = "decode") -> float:
        return self._r.host_ms_per_step(kind)

    def mixed_graph_buckets(self) -> list[int]:
        """The token counts of the piecewise graphs of steps with prefills (none: empty)."""
        pw = self._r.piecewise
        return [] if pw is None else sorted(pw.pieces)

    def attention_call_host_us(self, calls: int = 200) -> dict[str, float]:
        """Host microseconds one eager call of the backend's prefill and decode kernels takes
        (flash-attn: the calls a step with prefills makes per layer), launched back to back on
        a one-page cache; empty for other backends or without a GPU."""
        r = self._r
        st = r.attn_state
        if not hasattr(st, "_scratch_metadata") or r.device.type != "cuda":
            return {}
        spec, cache = r.specs[0], r.kv_caches[0]
        out = {}
        for name, run, n, q_len in (("prefill 2 x 256", st.prefill, 2, 256),
                                    ("decode 256", st.decode, 256, 1)):
            md = st._scratch_metadata(n, q_len, 8)
            q = torch.zeros(n * q_len, spec.num_heads, spec.head_size, dtype=r.dtype,
                            device=r.device)
            run(q, cache[0], cache[1], md, spec)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                run(q, cache[0], cache[1], md, spec)
            out[name] = 1e6 * (time.perf_counter() - t0) / calls
            torch.cuda.synchronize()
        return out

    @contextlib.contextmanager
    def without_graphs(self) -> Iterator[None]:
        """Steps inside run eagerly (the reference a profile attributes graph replays to)."""
        r = self._r
        graphs, r.graphs = r.graphs, None
        try:
            yield
        finally:
            r.graphs = graphs

    @contextlib.contextmanager
    def cascade_off(self) -> Iterator[None]:
        """Decode steps inside attend every sequence's whole context (no cascade)."""
        b = self._r.builder
        was, b.cascade = b.cascade, False
        try:
            yield
        finally:
            b.cascade = was
