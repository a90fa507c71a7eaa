"""The model runner's step inputs (``ModelRunner.prepare``), on a CPU: prefill chunks first,
then decodes; each new token's position and cache slot; a window group's own page tables; a
decode's token still being sampled by the step in flight taken from that step's tokens."""

from __future__ import annotations

import torch
from hf_models import make_checkpoint

from pagedgen.runtime.config import SamplingParams
from pagedgen.runtime.engine.scheduler import ScheduledBatch
from pagedgen.runtime.engine.sequence import PENDING_TOKEN, Sequence
from tests.test_engine import tiny


def running(eng, seq_id: int, prompt: list[int], computed: int, out: list[int] = ()) -> Sequence:
    """A sequence with ``computed`` tokens in the cache and pages for its next step."""
    seq = Sequence(seq_id, list(prompt), SamplingParams(), 0)
    for t in out:
        seq.append_token(t)
    seq.num_computed_tokens = computed
    eng.block_manager.allocate(seq, seq.num_tokens)
    return seq


def slots(seq: Sequence, positions, bs: int, table=None) -> list[int]:
    table = seq.block_table if table is None else table
    return [table[p // bs] * bs + p % bs for p in positions]


def test_a_step_lists_prefill_chunks_then_decodes_with_their_positions_and_slots():
    eng = tiny(block_size=4)
    bs = eng.runner.block_size
    a = running(eng, 0, list(range(100, 110)), computed=3)  # a chunk: tokens 3..8
    b = running(eng, 1, list(range(200, 207)), computed=7, out=[42])  # decodes token 7
    ids, pos, md = eng.runner.prepare(ScheduledBatch(prefills=[(a, 6)], decodes=[b]))
    assert ids.tolist() == list(range(103, 109)) + [42]
    assert pos.tolist() == [3, 4, 5, 6, 7, 8, 7]
    assert md.slot_mapping.tolist() == slots(a, range(3, 9), bs) + slots(b, [7], bs)
    assert md.query_start_loc.tolist() == [0, 6, 7] and md.num_prefills == 1
    assert md.seq_lens.tolist() == [9, 8] and md.context_lens.tolist() == [3, 7]
    for row, seq in zip(md.block_tables.tolist(), (a, b)):
        assert row[:len(seq.block_table)] == seq.block_table


def test_a_token_still_being_sampled_comes_from_the_step_in_flight():
    eng = tiny(block_size=4)
    b = running(eng, 1, list(range(200, 207)), computed=7, out=[PENDING_TOKEN])
    c = running(eng, 2, list(range(300, 305)), computed=5, out=[PENDING_TOKEN])
    eng.runner.last_sampled, eng.runner.last_tokens = [c, b], torch.tensor([77, 66])
    ids, _, _ = eng.runner._build(ScheduledBatch(decodes=[b, c]))  # as a step with prefills
    assert ids.tolist() == [66, 77]


def test_a_window_group_attends_over_its_own_page_tables(tmp_path):
    ckpt = make_checkpoint("gpt_oss", tmp_path / "gpt_oss")  # 1:1 windows and full layers
    eng = tiny(model=str(ckpt), block_size=4, load_format="auto")
    groups = eng.runner.layout.groups  # the full layer, then each window layer's group
    assert groups[0].window is None and {g.window for g in groups[1:]} == {12}
    seq = running(eng, 0, list(range(30)), computed=29)  # decodes its last token, at 29
    _, _, md = eng.runner.prepare(ScheduledBatch(decodes=[seq]))
    assert len(md.kv_groups) == len(groups) - 1
    bs = eng.runner.block_size
    assert md.slot_mapping.tolist() == slots(seq, [29], bs)
    for k, group in enumerate(md.kv_groups):
        table = seq.group_tables[k]
        assert seq.group_first[k] == (29 - 12 + 1) // bs  # pages before the window let go
        assert not set(table[seq.group_first[k]:]) & set(seq.block_table)  # pages of its own
        assert group.block_tables.tolist()[0][:len(table)] == table
        assert group.slot_mapping.tolist() == slots(seq, [29], bs, table)


def test_the_measurement_reads_the_worker_and_puts_its_switches_back():
    """``Engine.measurement()``: a decode step's least bytes from the KV cache's own figures,
    the decode reads since a mark, and the graphs and cascade switches restored after."""
    eng = tiny(block_size=4)
    m = eng.measurement()
    figures = m.figures()
    assert figures["backend"] == eng.backend_name and figures["tensor_parallel_size"] == 1
    least = m.decode_bytes(8, 20)
    assert least["kv"] == 8 * 20 * m.kv_bytes_per_token() and least["state"] == 0
    assert least["weights"] == eng.runner.model.step_weight_bytes(8)
    mark = m.decode_reads()
    eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0.0))
    eng.run()
    assert m.decode_reads_since(mark)["decode_kv_plain_gb_per_step"] > 0
    eng.runner.graphs, was_cascade = "graphs", eng.runner.builder.cascade
    with m.without_graphs(), m.cascade_off():
        assert eng.runner.graphs is None and eng.runner.builder.cascade is False
    assert eng.runner.graphs == "graphs" and eng.runner.builder.cascade == was_cascade
    eng.runner.graphs = None
