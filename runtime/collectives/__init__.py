"""Tensor parallelism under the model: the process group and its collectives (``parallel``),
the all-reduce fused with the RMSNorm after it (``fused_all_reduce``), and how a parameter's
rows or columns are split over the ranks (``sharding``)."""
