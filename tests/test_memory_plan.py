"""The KV cache's size from the memory profile, on a CPU with the GPU's counters faked: the
profile's own K/V pages are not counted against the cache that replaces them; a vision
tower's largest call is."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedgen.runtime.worker import memory_plan

TOTAL = 1_000_000


class FakeGPU:
    """torch.cuda's memory counters over allocations the fakes below make."""

    def __init__(self, weights: int, elsewhere: int) -> None:
        self.allocated = self.peak = weights
        self.elsewhere = elsewhere  # outside torch (the CUDA context, say)

    def take(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        c = torch.cuda
        monkeypatch.setattr(c, "empty_cache", lambda: None)
        monkeypatch.setattr(c, "synchronize", lambda device=None: None)
        monkeypatch.setattr(c, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(c, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(c, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(c, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(c, "mem_get_info", lambda device=None: (
            TOTAL - self.allocated - self.elsewhere, TOTAL))
        monkeypatch.setattr(c, "get_device_properties",
                            lambda device=None: SimpleNamespace(total_memory=TOTAL))


def test_the_profiles_own_pages_are_not_counted_against_the_kv_cache(monkeypatch):
    gpu = FakeGPU(weights=500_000, elsewhere=20_000)
    gpu.install(monkeypatch)
    page, activations = 100, 30_000

    def allocate(blocks):
        gpu.take(blocks * page)
        return []

    def forward(ids, pos, caches, md):  # its activations come and go
        gpu.take(activations)
        gpu.take(-activations)
        return torch.zeros(len(ids), 4)

    class Builder:
        def build(self, seqs, decodes):
            return SimpleNamespace()

        def build_group(self, md, tables):
            return SimpleNamespace()

    class Model:
        __call__ = staticmethod(forward)

        def compute_logits(self, h):
            return None

    taken: list[int] = []
    kv = SimpleNamespace(allocate=lambda blocks: taken.append(blocks) or allocate(blocks),
                         free=lambda: gpu.take(-taken[-1] * page))
    runner = SimpleNamespace(
        config=SimpleNamespace(max_num_batched_tokens=640, gpu_memory_utilization=0.9),
        device=torch.device("cpu"), block_size=16, max_num_seqs=8, max_model_len=320,
        scratch_slot=0, builder=Builder(), plan=lambda md: md,
        layout=SimpleNamespace(groups=[None]), kv=kv, model=Model(), images=None)
    free_bytes = memory_plan.profile_free_memory(runner)
    assert taken == [40]  # two sequences of 320 tokens on pages of 16
    # the budget less the weights, the forward's activations and memory outside torch: the
    # profile's 40 pages (4,000 bytes) go back to the cache
    assert free_bytes == int(TOTAL * 0.9) - 500_000 - activations - 20_000
    # a model with a vision tower: its embeddings cache's bound kept off the KV cache too,
    # and its largest call's activations where they are more than the forward's
    tower = activations + 3_000
    runner.images = SimpleNamespace(capacity_bytes=7_000,
                                    profile=lambda: gpu.take(tower) or gpu.take(-tower))
    assert memory_plan.profile_free_memory(runner) == free_bytes - 7_000 - 3_000
