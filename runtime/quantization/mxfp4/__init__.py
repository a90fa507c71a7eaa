"""The MXFP4 weight format: ``codes`` (e2m1 values, e8m0 scales, the kernels' layout), ``moe``
(4-bit experts), ``kernels`` (the conversion's Triton device functions), ``format`` (what it
reads from a checkpoint and gives a layer)."""

from pagedgen.runtime.quantization.mxfp4.format import Mxfp4Format

FORMAT = Mxfp4Format()
