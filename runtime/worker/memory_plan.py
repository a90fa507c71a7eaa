"""How many KV-cache pages a run gets: as an option sizes them (``num_blocks``,
``kv_cache_memory``), else what the GPU has left after a forward of the largest step (and,
for a model with a vision tower, the tower over the largest image a step takes: as vLLM
profiles them, less the bound of its embeddings cache), else on a CPU what the batch could
use, at most 1 GiB.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedgen.attention.metadata import ScheduledSeq
from pagedgen.runtime.config import EngineConfig, parse_bytes
from pagedgen.runtime.worker.kv_memory import KVMemory

CPU_DEFAULT_KV_BYTES = 1 << 30


def asked_kv_cache(cfg: EngineConfig, kv: KVMemory) -> tuple[int, str] | None:
    """(bytes, the setting as given) of a KV cache an option sizes, checked against free
    memory with the weights before they load."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks * kv.block_bytes(), f"{cfg.named('num_blocks')} {cfg.num_blocks:,}"
    if cfg.kv_cache_memory is not None:
        return (parse_bytes(cfg.kv_cache_memory),
                f"{cfg.named('kv_cache_memory')} {cfg.kv_cache_memory}")
    return None


def num_blocks(runner: Any) -> int:
    """The pool's pages for ``runner`` (a ``ModelRunner`` whose model, backend states and
    metadata builder exist): ``num_blocks`` is the memory of that many blocks of every layer."""
    cfg, kv = runner.config, runner.kv
    if cfg.num_blocks is not None:
        n = cfg.num_blocks * kv.block_bytes() // kv.page_bytes()
    elif cfg.kv_cache_memory is not None:
        n = parse_bytes(cfg.kv_cache_memory) // kv.page_bytes()
    elif runner.device.type == "cuda":
        n = profile_free_memory(runner) // kv.page_bytes()
    else:  # CPU: what the batch could use, at most 1 GiB, at least one whole sequence
        per_seq = kv.seq_pages(runner.max_model_len)
        want = runner.max_num_seqs * per_seq + 1  # +1: the scratch block
        n = max(min(want, CPU_DEFAULT_KV_BYTES // kv.page_bytes()), per_seq + 1)
    return max(0, int(n))


def profile_free_memory(runner: Any) -> int:
    """GPU bytes left for the KV cache after a forward at the largest batch (as vLLM does).
    The pages that forward writes its K/V to are not counted: the KV cache takes their place
    (counted, they left every cache ``max_num_batched_tokens`` token slots short: 16,384, 7.7%
    of gpt-oss-120b's 213,408 on an H100)."""
    cfg, device, bs = runner.config, runner.device, runner.block_size
    tokens = min(cfg.max_num_batched_tokens, runner.max_num_seqs * runner.max_model_len)
    seq_len = min(runner.max_model_len, tokens)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    blocks = sum(math.ceil(n / bs) for n in lens)
    # the peak from here: the live weights and this forward's own, not the build's
    # transients (dummy experts are drawn whole, a layer at a time, then quantized)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    caches = runner.kv.allocate(blocks)
    own_pages = torch.cuda.memory_allocated(device) - before  # the cache takes their place
    table, start, seqs = list(range(blocks)), 0, []
    for n in lens:
        nb = math.ceil(n / bs)
        seqs.append(ScheduledSeq(table[start:start + nb], 0, n, runner.scratch_slot))
        start += nb
    md = runner.builder.build(seqs, [])  # every group on the same pages, as big as group 0
    md.kv_groups = [runner.builder.build_group(md, [s.block_table for s in seqs])
                    for _ in runner.layout.groups[1:]]
    md = runner.plan(md)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    with torch.inference_mode():
        h = runner.model(ids, pos, caches, md)
        runner.model.compute_logits(h[:runner.max_num_seqs])
        if runner.images is not None:  # the tower's largest call
            runner.images.profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - own_pages
    del caches, h, md
    runner.kv.free()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    used_elsewhere = total - torch.cuda.mem_get_info(device)[0] - torch.cuda.memory_reserved(device)
    cache = runner.images.capacity_bytes if runner.images is not None else 0  # embeddings
    return int(total * cfg.gpu_memory_utilization - peak - used_elsewhere - cache)
