"""Every environment variable pagedgen reads, in one list, with its meaning and default: a
module reads its own through ``EnvVar.get`` (never ``os.environ`` by name), and
``pagedgen backends`` prints the list with the values set now. None of them is needed: each
overrides a choice the code makes (by measurement, or by the device) for experiments."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what unset means, in words ("" where the code decides)
    meaning: str

    def get(self) -> str | None:
        """The value set, or None (an empty value counts as unset)."""
        return os.environ.get(self.name) or None


FLASH_ATTN = EnvVar("PAGEDGEN_FLASH_ATTN", "fa4, else fa3, else fa2 (what is installed)",
                    "fa4, fa3 or fa2: the flash-attn backend's flavour")
FA4_DECODE_TILE = EnvVar("PAGEDGEN_FA4_DECODE_TILE", "64x64 on SM90, FA4's own elsewhere",
                         "FA4's decode tile, ROWSxKEYS (64x128), or fa4 for FA4's own")
FA4_PREFILL_TILE = EnvVar("PAGEDGEN_FA4_PREFILL_TILE",
                          "128x64 for head sizes over 128 on SM90 with 64-token pages, FA4's own "
                          "elsewhere",
                          "FA4's prefill tile for every head size, ROWSxKEYS, or fa4")
FA4_GROUP_TILE = EnvVar("PAGEDGEN_FA4_GROUP_TILE", "64x128 on SM90, FA4's own elsewhere",
                        "FA4's tile for cascade decode's shared-prefix calls, or fa4")
FA4_CASCADE_SUFFIX = EnvVar("PAGEDGEN_FA4_CASCADE_SUFFIX", "triton",
                            "what attends each row's own pages in FA4's cascade decode: "
                            "triton or fa4")
FLASHINFER_PREFILL = EnvVar("PAGEDGEN_FLASHINFER_PREFILL", "fa2",
                            "FlashInfer's prefill kernel: fa2, or fa3 (Hopper; a long first "
                            "compile)")
FLASHINFER_DECODE = EnvVar("PAGEDGEN_FLASHINFER_DECODE", "xqa where it runs",
                           "FlashInfer's decode kernel over an FP8 KV cache: xqa (Hopper; "
                           "TensorRT-LLM's) or fa2 (tensor-core paged decode)")
CASCADE_MERGE_HEADS = EnvVar("PAGEDGEN_CASCADE_MERGE_HEADS", "4",
                             "heads a program of cascade decode's merge kernel takes")
FP8_GEMM = EnvVar("PAGEDGEN_FP8_GEMM", "the measured plan per M",
                  "one FP8 GEMM kind for every M (e.g. scaled_mm, triton_tma/128x128x128, "
                  "dequantize)")
FP8_FUSED_INPUT = EnvVar("PAGEDGEN_FP8_FUSED_INPUT", "1",
                         "0: norms and SwiGLU never quantize activations for the FP8 GEMM after "
                         "them")
MOE_TILES = EnvVar("PAGEDGEN_MOE_TILES", "the measured plan per token count",
                   "one grouped-GEMM tile for every MoE call (e.g. m64n128k64g8w4s3)")
INVARIANT_ATTENTION_ROWS = EnvVar(
    "PAGEDGEN_INVARIANT_ATTENTION_ROWS", "16, or 4 positions of a KV head's query heads where "
    "more", "the rows of triton's attention tiles under --batch-invariant (a power of two; a "
    "decode fills its query heads' rows of one tile)")
INVARIANT_GEMM_PLAN = EnvVar(
    "PAGEDGEN_INVARIANT_GEMM_PLAN", "each weight shape's tiles timed per row count (once a "
    "machine)",
    "the dense GEMM's tiles under --batch-invariant by row count: ROWS:MxNxWARPSxSTAGES,... "
    "with the last tile for the rest (64:64x64x4x4,128x256x8x3)")
ALL_REDUCE = EnvVar("PAGEDGEN_ALL_REDUCE", "push: each rank stores its partial sums into its "
                    "peers' symmetric memory", "one-shot (PyTorch's symmetric-memory kernel) or "
                    "nccl: another tensor-parallel all-reduce")
FUSED_ALL_REDUCE = EnvVar("PAGEDGEN_FUSED_ALL_REDUCE", "1",
                          "0: the residual add and RMSNorm after a push all-reduce in a kernel "
                          "of their own")
SHIPPED_PLANS = EnvVar("PAGEDGEN_SHIPPED_PLANS", "1",
                       "0: kernel plans (FP8 GEMMs, MoE tiles) shipped for this GPU are passed "
                       "over: measured at load, or read from this machine's cache")
GATED_DELTA = EnvVar("PAGEDGEN_GATED_DELTA", "triton (+ FlashInfer's or fla's chunked prefill "
                     "where they run) on a GPU, torch on a CPU",
                     "torch, triton, or fla / flashinfer (triton with that chunked prefill): "
                     "the linear-attention (Gated DeltaNet) kernels")
GRAMMAR_WORKERS = EnvVar("PAGEDGEN_GRAMMAR_WORKERS", "one per two cores past two, 1-8, with "
                         "CUDA; 0 without", "grammar worker processes (0: in the engine's)")
HOST_PROCESSES = EnvVar("PAGEDGEN_HOST_PROCESSES", "1 (set by pagedgen for its workers)",
                        "how many pagedgen processes share this host's cores")
VISION_ATTENTION = EnvVar("PAGEDGEN_VISION_ATTENTION", "sdpa (FA4's packed call is not yet "
                          "measured on a GPU)", "a vision tower's attention: sdpa (an image at a "
                          "time, cuDNN left out) or fa4 (one varlen call, where FA4 runs)")
VLLM_SITE = EnvVar("PAGEDGEN_VLLM_SITE", "/tmp/site-vllm, where vLLM does not import here",
                   "the site-packages folder holding vLLM for `bench throughput --peer vllm` "
                   "and the benchmarks' peer")

ALL: tuple[EnvVar, ...] = (FLASH_ATTN, FA4_DECODE_TILE, FA4_PREFILL_TILE, FA4_GROUP_TILE,
                           FA4_CASCADE_SUFFIX, FLASHINFER_PREFILL, FLASHINFER_DECODE,
                           CASCADE_MERGE_HEADS, FP8_GEMM,
                           FP8_FUSED_INPUT, MOE_TILES, INVARIANT_ATTENTION_ROWS,
                           INVARIANT_GEMM_PLAN,
                           SHIPPED_PLANS, ALL_REDUCE,
                           FUSED_ALL_REDUCE, GATED_DELTA, GRAMMAR_WORKERS, HOST_PROCESSES,
                           VISION_ATTENTION, VLLM_SITE)
