"""The engine: requests in, finished sequences out, one scheduled step at a time (``engine``:
the loop, over the worker and the output stage), and what it schedules with: requests and
sequences, the scheduler, the KV groups, blocks and prefix cache, step statistics."""
