"""What the attention backends stand on: paged KV-cache operations (``kv_cache``), our Triton
kernels (``triton_kernels``), host-to-device uploads that do not wait for the GPU
(``transfer``) and the named ranges torch.profiler reports (``profiling``)."""
