"""Linear attention whose memory is a recurrent state, not paged K/V: the gated delta rule
(Gated DeltaNet: Qwen3.5, Qwen3-Next).

Each running sequence holds a state slot (``state.py``): per linear-attention layer the
delta-rule matrix [value heads, value dim, key dim] and the causal convolution's last inputs.
The step's metadata carries each sequence's slot (``AttentionMetadata.state_slots``), as it
carries each sequence's pages; ``gated_delta.py`` runs a layer over it: the torch reference
(``reference.py``, every device, and the tests' and ``verify``'s oracle), our Triton kernels
(``triton_kernels.py``), and flash-linear-attention's chunked prefill where it is installed.
"""
