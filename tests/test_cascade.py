"""Cascade decode: which pages a decode batch shares (attention/metadata.py), on the CPU.
The kernels are checked in test_triton.py (CPU interpreter) and the GPU tests."""

from __future__ import annotations

import torch

from pagedgen.attention.metadata import AttentionMetadataBuilder, ScheduledSeq
from pagedgen.attention.metadata import MIN_SEQS, MIN_TOKENS, common_prefix_blocks

PAGE = 16
SHARED = MIN_TOKENS // PAGE  # pages


def tables(rows: int, shared: int, own: int = 3) -> torch.Tensor:
    return torch.tensor([list(range(shared)) + [1000 + 10 * r + i for i in range(own)]
                         for r in range(rows)], dtype=torch.int32)


def test_shared_pages_are_the_common_leading_columns():
    t = tables(MIN_SEQS, SHARED + 2)
    assert common_prefix_blocks(t, 10_000, PAGE) == SHARED + 2
    t[3, SHARED + 1] = 999  # one row departs: the prefix ends there
    assert common_prefix_blocks(t, 10_000, PAGE) == SHARED + 1


def test_no_cascade_below_the_thresholds():
    assert common_prefix_blocks(tables(MIN_SEQS - 1, 40), 10_000, PAGE) == 0
    assert common_prefix_blocks(tables(MIN_SEQS, SHARED - 1), 10_000, PAGE) == 0
    t = tables(MIN_SEQS, 40)
    t[:, 0] = torch.arange(MIN_SEQS)  # nothing shared from the first page on
    assert common_prefix_blocks(t, 10_000, PAGE) == 0


def test_every_sequence_keeps_its_newest_token_out_of_the_prefix():
    t = tables(MIN_SEQS, SHARED + 4, own=0)  # identical tables (e.g. forked samples)
    # the shortest sequence holds SHARED + 1 pages and one token: its newest token's page
    # stays a suffix page, so SHARED + 1 pages are shared
    assert common_prefix_blocks(t, (SHARED + 1) * PAGE + 1, PAGE) == SHARED + 1
    # a sequence ending exactly on a page boundary keeps that whole last page
    assert common_prefix_blocks(t, (SHARED + 1) * PAGE, PAGE) == SHARED


def test_builder_marks_decode_only_steps():
    seqs = [ScheduledSeq(list(range(SHARED)) + [500 + r], SHARED * PAGE + 3, 1)
            for r in range(MIN_SEQS)]
    dev = torch.device("cpu")
    assert AttentionMetadataBuilder(PAGE, dev, cascade=True).build([], seqs).cascade_blocks \
        == SHARED
    assert AttentionMetadataBuilder(PAGE, dev).build([], seqs).cascade_blocks == 0
    prefill = ScheduledSeq([900], 0, 4)
    md = AttentionMetadataBuilder(PAGE, dev, cascade=True).build([prefill], seqs)
    assert md.cascade_blocks == 0  # mixed steps run plain
