"""The FP8 (e4m3) weight format: ``scheme`` (linear layers), ``moe`` (experts), ``kernels``
(quantization and the Triton GEMMs), ``gemm`` (the GEMM chosen per M), ``format`` (what it
reads from a checkpoint and gives a layer)."""

from pagedgen.runtime.quantization.fp8.format import Fp8Format

FORMAT = Fp8Format()
