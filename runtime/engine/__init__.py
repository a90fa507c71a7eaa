"""The engine: requests in, finished sequences out, one scheduled step at a time (``engine``),
over the scheduler, the KV blocks and prefix cache, the model runner and its CUDA graphs."""
