"""A request's life in the engine: its tokens, its block table, its state and timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedgen.runtime.config import SamplingParams

PENDING_TOKEN = -1  # an output token whose step is still running on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its KV is recomputed when readmitted)
    RUNNING = "running"  # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = "finished"


# why a sample ended: EOS, a stop token or string; max_tokens or the context; its structured
# output's grammar allowing no next token
FINISH_REASONS = ("stop", "length", "unsatisfiable")
# as output lines give them for a sample that ended before its reasoning did (no answer)
REASONING_FINISH_REASONS = ("stop_in_reasoning", "length_in_reasoning")


@dataclass(eq=False)  # identity: queues of thousands must never compare token lists
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # per-request sampling seed
    request: Any = None  # caller's handle (e.g. the JSONL request)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # group 0's (kv_groups.py)
    # each further KV group's table (its entries before ``group_first`` were let go as its
    # window slid: stale ids, never read unmasked), and where its held blocks begin
    group_tables: list[list[int]] = field(default_factory=list)
    group_first: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its recurrent-state slot (models with linear attention)
    mm: Any = None  # its prompt's images (runtime/models/multimodal.py's MultiModalPrompt)
    finish_reason: str | None = None  # one of FINISH_REASONS
    stop_text_end: int | None = None  # where a stop string starts in the output text
    stop_reason: int | str | None = None  # the stop token or string that ended it (vLLM's)
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None  # set when its last token is known: the sample is done
    # parallel sampling: sample `sample_index` of a request with params.n samples; `samples`
    # (shared by all of them) lists them; `forks` holds the ones still to fork from this one
    # when its prompt's prefill completes
    sample_index: int = 0
    samples: list[Sequence] | None = None
    forks: list[Sequence] = field(default_factory=list)
    # prefix caching: keys of its full blocks (prefix_cache.block_keys), and how many of its
    # leading blocks are registered in the cache
    block_keys: list = field(default_factory=list)
    num_cached_blocks: int = 0
    # log-probabilities, when asked for (runtime.logprobs.Entry): one per output token, and one
    # per prompt token after the first (sample 0 of a request holds the prompt's)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # change this sample's logits before sampling (runtime.sampling.processors)
    logits_processors: list = field(default_factory=list)
    # params.bad_words tokenized (runtime.sampling.controls), set when the request is added
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # params.structured's matcher (runtime.sampling.structured.GrammarState), one per sample
    grammar: Any = None
    # with stop strings: the text as tokens come (detokenizer.IncrementalDetokenizer) and the
    # search for them (detokenizer.StopChecker)
    detok: Any = None
    stop_checker: Any = None
    # a reasoning model's: where its reasoning and its answer are (reasoning.ReasoningState)
    reasoning: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output, appended in place
        # any sampling control beyond temperature/top-k/top-p (read per step: kept here)
        self.controlled = self.params.has_controls()
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.sample_index == 0:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model; 1 means the sequence is decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but trailing placeholders of steps in flight)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] == PENDING_TOKEN:
            n -= 1
        return n

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
