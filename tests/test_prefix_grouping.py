"""Requests whose prompts share a prefix are admitted together (runtime/engine/ordering.py)."""

from __future__ import annotations

import pytest

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine import ordering
from pagedgen.runtime.engine.engine import Engine


@pytest.fixture
def blocks_of_two(monkeypatch):
    monkeypatch.setattr(ordering, "GROUP_TOKENS", 2)


def order(prompts: dict[str, list[int]], window: int = ordering.WINDOW) -> list[str]:
    return list(ordering.prefix_grouped(prompts, lambda name: prompts[name], window))


def test_requests_join_the_first_one_they_share_a_prefix_with(blocks_of_two):
    a, b, c = [3, 3, 3, 3], [1, 1, 1, 1], [2, 2, 2, 2]  # three documents, two blocks each
    prompts = {"a1": a + [9], "b1": b + [9], "c1": c + [9], "x": [0, 6, 7], "a2": a + [8],
               "b2": b + [8], "a3": a + [7, 7, 7]}
    assert order(prompts) == ["a1", "a2", "a3", "b1", "b2", "c1", "x"]


def test_nested_prefixes_group_level_by_level(blocks_of_two):
    s, t, d1, d2 = [1, 1], [2, 2], [5, 5], [6, 6]  # system prompts, then documents
    prompts = {"s-d1-q1": s + d1 + [7, 7], "s-d2-q1": s + d2 + [7, 7], "t-d1-q1": t + d1 + [7, 7],
               "s-d1-q2": s + d1 + [8, 8], "s-d2-q2": s + d2 + [8, 8], "s": s}
    assert order(prompts) == ["s-d1-q1", "s-d1-q2", "s-d2-q1", "s-d2-q2", "s", "t-d1-q1"]


def test_prompts_that_share_nothing_keep_input_order(blocks_of_two):
    prompts = {f"p{i}": [(7 * i) % 11, i, i] for i in range(11)}
    prompts["short"] = [4]  # shorter than a block
    assert order(prompts) == list(prompts)


def test_blocks_that_differ_inside_are_not_shared(monkeypatch):
    monkeypatch.setattr(ordering, "GROUP_TOKENS", 4)
    prompts = {"p1": [1, 2, 3, 9, 5], "p2": [7, 7, 7, 7], "p3": [1, 8, 8, 9, 6],
               "p4": [1, 2, 3, 9, 4]}  # p3 begins and ends its first block as p1 does
    assert order(prompts) == ["p1", "p4", "p2", "p3"]


def test_grouping_stays_within_a_window(blocks_of_two):
    prompts = {"a1": [1, 1, 1], "b1": [2, 2, 1], "c1": [3, 3, 1], "a2": [1, 1, 2],
               "b2": [2, 2, 2]}
    assert order(prompts, window=3) == ["a1", "b1", "c1", "a2", "b2"]
    assert order(prompts, window=4) == ["a1", "a2", "b1", "c1", "b2"]


def run(grouping: bool, prompts: list[list[int]], num_blocks: int):
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy", dtype="float32",
                              block_size=16, num_blocks=num_blocks, max_num_seqs=4,
                              max_num_batched_tokens=512, prefix_grouping=grouping))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_requests((p, params, i, i) for i, p in enumerate(prompts))
    done = {}
    eng.run(on_finish=lambda s: done.setdefault(s.request, s.output_token_ids))
    return eng, [done[i] for i in range(len(prompts))]


def test_questions_about_one_document_reuse_its_cached_blocks():
    """Eight documents of 160 tokens, three questions each, listed question by question: in
    input order the cache (24 blocks of 16) has evicted a document's blocks before its next
    question comes; grouped, each document is computed once. The tokens are the same."""
    docs = [[(97 * d + 13 * j) % 250 + 1 for j in range(160)] for d in range(8)]
    prompts = [doc + [251 + q] * 5 for q in range(3) for doc in docs]
    plain, out_plain = run(False, prompts, num_blocks=24)
    grouped, out_grouped = run(True, prompts, num_blocks=24)
    assert out_grouped == out_plain
    hit_plain, hit_grouped = plain.stats.prefix_hit_tokens, grouped.stats.prefix_hit_tokens
    assert hit_grouped == 8 * 2 * 160  # each document's 10 blocks, for its 2nd and 3rd question
    assert hit_plain < hit_grouped / 4
    assert grouped.summary(1.0, 0.0)["prefix_grouping"] is True
    assert plain.summary(1.0, 0.0)["prefix_grouping"] is False


def test_generate_keeps_input_order_and_each_line_s_sample(tmp_path):
    """Grouped admission changes only when lines run: the output file is in input order, and
    each line's sampled tokens (temperature 1, seeds from the line's position) are the same as
    in input order."""
    import json

    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    docs = [[(31 * d + j) % 200 + 1 for j in range(130)] for d in range(4)]
    src = tmp_path / "q.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{q}-d{d}", "prompt_token_ids": doc + [201 + q]})
                           + "\n" for q in range(3) for d, doc in enumerate(docs)))
    outs = {}
    for flag in ("--prefix-grouping", "--no-prefix-grouping"):
        out = tmp_path / f"{flag}.jsonl"
        res = CliRunner().invoke(app, ["generate", str(src), "-o", str(out), "--device", "cpu",
                                       "--max-tokens", "3", "--temperature", "1", "--json",
                                       "--max-num-seqs", "2", flag])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout[res.stdout.index("{"):])["prefix_grouping"] == \
            (flag == "--prefix-grouping")
        outs[flag] = [json.loads(line) for line in out.read_text().splitlines()]
    grouped, plain = outs["--prefix-grouping"], outs["--no-prefix-grouping"]
    assert [r["id"] for r in grouped] == [f"q{q}-d{d}" for q in range(3) for d in range(4)]
    assert [r["token_ids"] for r in grouped] == [r["token_ids"] for r in plain]
