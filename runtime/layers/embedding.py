"""The token embedding and the LM head, split by vocabulary under tensor parallelism.

Each rank holds a slice of the vocabulary (padded to a multiple of the ranks); lookups outside
it give zeros, then an all-reduce. As the LM head, each rank's logits for its slice are
all-gathered. Both stay in the model's dtype whatever quantization the linear layers use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.collectives.sharding import Segment
from pagedgen.runtime.quantization.dense_gemm import linear
from pagedgen.runtime.quantization.invariant_gemm import invariant_linear


class VocabParallelEmbedding(nn.Module):
    """An embedding table of which this rank holds rows ``[lo, lo + rows)``; padded rows of the
    last rank stay zero. ``logits`` uses it as the LM head."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.batch_invariant = False  # logits in invariant tiles (invariant_gemm.py)
        self.rows = -(-vocab_size // tp.size)
        self.lo = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        have = max(0, min(self.rows, vocab_size - self.lo))
        self.shards = {"weight": (0, [Segment(None, vocab_size, self.lo, have, 0)])}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.lo
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits over the whole vocabulary: this rank's slice computed here, the others
        gathered; float32, or the model's dtype where ``float32`` is False (a step's sampling
        upcasts only what needs it)."""
        local = (invariant_linear if self.batch_invariant else linear)(hidden, self.weight)
        return self.tp.all_gather(local.float() if float32 else local)[..., :self.vocab_size]
