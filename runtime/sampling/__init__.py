"""From logits to tokens: per-sequence logits processors (``processors``), the seeded sampler
(``sampler``) and log-probabilities (``logprobs``)."""
