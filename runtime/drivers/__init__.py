"""Runs over the engine: one engine replica (``replica``), and the drivers that run a job's
requests on engines in this process, in worker processes on this host (``data_parallel`` over
``launch``), on Ray Data (``ray_data``) or as a torchrun rank, all behind one interface
(``driver``)."""
