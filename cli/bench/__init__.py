"""`pagedgen bench`: measurements a user runs on their own machine (offline throughput,
one batch's latency), as `vllm bench` takes them."""
