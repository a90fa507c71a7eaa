"""The model's building blocks: linear layers with a quantization method (``linear``), the
vocabulary-split embedding and LM head (``embedding``), RMSNorm, rotary, SwiGLU, the paged
attention layer, the fused Triton kernels behind them, and how tensor parallelism shards
parameters (``sharding``)."""
