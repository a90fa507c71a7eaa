"""The worker: runs the engine's scheduled steps on a device (``model_runner``: the model, its
attention backends per KV group, the KV memory and its plan, CUDA graphs and piecewise graphs,
decode advance, recurrent state slots, the vision tower's step, the start-up warm-up, the
batch-invariant mode, the JIT monitor)."""
