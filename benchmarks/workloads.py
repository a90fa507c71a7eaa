"""The benchmark workloads: prompt token ids and output lengths, generated from a seed so that
every system (and the vLLM peer, in a process of its own) runs exactly the same requests.

  a: Llama-3-8B shape, 256 prompts x random 128-1024 input, 256 output tokens
  b: Llama-3-8B shape, 64 prompts x 2048 input, 128 output tokens
  c: Qwen3-0.6B shape, 256 prompts x random 100-1024 input and output (nano-vllm's setup)
  d: Llama-3-8B shape, 512 prompts x (1,536 shared + 128 unique) input, 128 output (one system
     prompt or few-shot block in front of every question: prefix caching)
  p: Llama-3-8B shape, 128 prompts x 1,024 input, n = 8 samples x 256 output, temperature 1
     (parallel sampling)
  r: Llama-3-8B shape, 100,000 prompts x random 64-256 input, 16 output (request count)
  s: Llama-3-8B shape, 1,000 requests each behind one of 4 system prompts of 400-800 tokens
     (dealt at random), 20-600 own tokens, 16-512 output (several system prompts)
  q: Llama-3-8B shape, 256 documents of 1,024 tokens, 4 questions (16-48 tokens) about each,
     listed question by question (1,024 requests), 32 output, in a KV cache of 196,608 tokens:
     fewer than the documents (long shared prefixes under a memory budget)
  m: Qwen3-30B-A3B shape (MoE: 128 experts, 8 per token), (a)'s requests
  x: Mixtral-8x7B shape (MoE: 8 experts, 2 per token; needs an H200), (a)'s requests
  h: Qwen3.5-9B shape (hybrid: Gated DeltaNet linear attention, 3 layers to 1), (a)'s requests
  j: Qwen3.5-35B-A3B shape (hybrid MoE: 256 experts, 8 per token, a shared expert), (a)'s
  l: Qwen3.5-9B shape, 32 prompts x random 8,192-30,000 input, 128 output (long prompts)
  k: Qwen3.5-35B-A3B shape, (l)'s requests (the MoE preset on long prompts)
  o: gpt-oss-20b shape (MXFP4 experts: 32, 4 per token; attention sinks), (a)'s requests
  g: gpt-oss-120b shape (MXFP4 experts: 128, 4 per token; one H100 holds it), (a)'s requests
  t: Llama-3-8B shape, 512 prompts x 1,000 input, 1,000 output (TensorRT-LLM's published
     H100 shape; with ``--quantization fp8 --set kv_cache_dtype=fp8``: FP8 weights and KV)
  e: Gemma-3-27B shape (5:1 windows of 1,024), 16 prompts x random 8,192-30,000 input, 128
     output (long prompts: the window layers' pages decide how many run at once)
  f: Gemma-3-12B shape, (e)'s requests
  mt, ot, jt: m, o and j sampled at temperature 1 (request i seeded i): decode tokens as
     varied as sampling makes them (``output_spread`` counts them). Not a like-for-like MoE
     comparison with vLLM: sampling slowed it more than pagedgen (most likely its seeded
     sampling's host time), and its dummy weights route differently whatever the tokens;
     that comparison is ``peers.py --vllm-weights normal``
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Workload:
    profile: str
    num_prompts: int
    input_len: tuple[int, int]  # each prompt's own tokens (after the shared prefix)
    output_len: tuple[int, int]
    shared_prefix_len: int = 0
    n: int = 1  # samples per prompt
    temperature: float = 0.0
    system_prompts: int = 0  # each request behind one of this many prompts...
    system_len: tuple[int, int] = (0, 0)  # ...of these lengths
    # with ``questions``: every system prompt (a document) is asked this many questions,
    # listed question by question (num_prompts = documents x questions)
    questions: int = 0
    kv_cache_tokens: int = 0  # the KV cache both systems get (0: as much as fits)

    def requests(self, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        """Prompt token ids and output lengths, the same for every system."""
        g = torch.Generator().manual_seed(seed)
        n = self.num_prompts
        lens = torch.randint(self.input_len[0], self.input_len[1] + 1, (n,), generator=g)
        outs = torch.randint(self.output_len[0], self.output_len[1] + 1, (n,), generator=g)
        shared = torch.randint(0, vocab, (self.shared_prefix_len,), generator=g).tolist()
        prompts = [shared + torch.randint(0, vocab, (int(l),), generator=g).tolist()
                   for l in lens]
        if self.system_prompts:
            lo, hi = self.system_len
            systems = [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,),
                                                                  generator=g)),),
                                     generator=g).tolist() for _ in range(self.system_prompts)]
            which = torch.randint(0, self.system_prompts, (n,), generator=g).tolist()
            if self.questions:
                which = [i % self.system_prompts for i in range(n)]
            prompts = [systems[w] + p for w, p in zip(which, prompts)]
        return prompts, outs.tolist()

    def sampling_params(self, sampling, outs: list[int]) -> list:
        """Each request's sampling as every pagedgen run of the workload has it: ``sampling``
        with the request's output length, EOS ignored, the workload's ``n`` and temperature,
        and request ``i`` seeded ``i`` where it samples."""
        return [replace(sampling, max_tokens=n, temperature=self.temperature, n=self.n,
                        seed=i if self.temperature else None, ignore_eos=True)
                for i, n in enumerate(outs)]

    def output_tokens(self, outs: list[int]) -> int:
        return sum(outs) * self.n


WORKLOADS = {
    "a": Workload("llama-3-8b", 256, (128, 1024), (256, 256)),
    "b": Workload("llama-3-8b", 64, (2048, 2048), (128, 128)),
    "c": Workload("qwen3-0.6b", 256, (100, 1024), (100, 1024)),
    "d": Workload("llama-3-8b", 512, (128, 128), (128, 128), shared_prefix_len=1536),
    "p": Workload("llama-3-8b", 128, (1024, 1024), (256, 256), n=8, temperature=1.0),
    "r": Workload("llama-3-8b", 100_000, (64, 256), (16, 16)),
    "s": Workload("llama-3-8b", 1000, (20, 600), (16, 512), system_prompts=4,
                  system_len=(400, 800)),
    "q": Workload("llama-3-8b", 1024, (16, 48), (32, 32), system_prompts=256,
                  system_len=(1024, 1024), questions=4, kv_cache_tokens=196_608),
    "m": Workload("qwen3-30b-a3b", 256, (128, 1024), (256, 256)),
    "x": Workload("mixtral-8x7b", 256, (128, 1024), (256, 256)),
    "h": Workload("qwen3.5-9b", 256, (128, 1024), (256, 256)),
    "j": Workload("qwen3.5-35b-a3b", 256, (128, 1024), (256, 256)),
    "l": Workload("qwen3.5-9b", 32, (8192, 30000), (128, 128)),
    "k": Workload("qwen3.5-35b-a3b", 32, (8192, 30000), (128, 128)),
    "o": Workload("gpt-oss-20b", 256, (128, 1024), (256, 256)),
    "g": Workload("gpt-oss-120b", 256, (128, 1024), (256, 256)),
    "t": Workload("llama-3-8b", 512, (1000, 1000), (1000, 1000)),
    "e": Workload("gemma-3-27b", 16, (8192, 30000), (128, 128)),
    "f": Workload("gemma-3-12b", 16, (8192, 30000), (128, 128)),
    "u": Workload("gemma-4-31b", 256, (128, 1024), (256, 256)),
    "w": Workload("gemma-4-31b", 16, (8192, 30000), (128, 128)),
    "y": Workload("gemma-4-26b-a4b", 256, (128, 1024), (256, 256)),
    "z": Workload("gemma-4-26b-a4b", 16, (8192, 30000), (128, 128)),
}
WORKLOADS |= {f"{k}t": replace(WORKLOADS[k], temperature=1.0) for k in ("m", "o", "j")}


SPREAD_KEYS = ("distinct_tokens_mid", "distinct_tokens_all")  # output_spread's figures


def output_spread(outputs: list[list[int]]) -> dict[str, int]:
    """How varied a run's output tokens are: distinct ids among the sequences' tokens at the
    middle of the shortest output (1: every sequence wrote the same token there; 0: no output,
    as scoring runs of ``max_tokens`` 0 have) and in all outputs."""
    mid = min(map(len, outputs), default=0) // 2
    return {"distinct_tokens_mid": len({o[mid] for o in outputs if len(o) > mid}),
            "distinct_tokens_all": len(set().union(*map(set, outputs))),
            "sequences": len(outputs)}


def workload(name: str, num_prompts: int | None = None) -> Workload:
    wl = WORKLOADS[name]
    return replace(wl, num_prompts=num_prompts) if num_prompts else wl
