"""Decode CUDA graph buckets (runtime/engine/cuda_graphs.py): which batch sizes get a graph."""

from __future__ import annotations

import pytest

from pagedgen.runtime.engine.cuda_graphs import graph_buckets


@pytest.mark.parametrize("seats", [1, 3, 8, 63, 128, 255, 256, 257, 300, 1024, 1000])
def test_every_batch_size_has_a_bucket_and_padding_stays_small(seats):
    b = graph_buckets(seats)
    assert b == sorted(set(b)) and b[0] >= 1 and b[-1] == seats
    for n in range(1, seats + 1):
        bucket = next(s for s in b if s >= n)
        # padding a step to its bucket: at most 8 rows to 64, 16 to 256, 32 beyond
        assert bucket - n < (8 if n <= 64 else 16 if n <= 256 else 32), (n, bucket)


def test_buckets_up_to_256_seats_are_those_of_every_earlier_release():
    assert graph_buckets(256) == [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16)]
    assert graph_buckets(100) == [1, 2, 4, *range(8, 65, 8), 80, 96, 100]


def test_a_thousand_seats_capture_steps_of_32_beyond_256():
    b = graph_buckets(1024)
    assert b[b.index(256):] == list(range(256, 1025, 32))
    assert len(b) == 47
