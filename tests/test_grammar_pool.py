"""The grammar pool (``runtime/sampling/grammar_pool.py``) behind structured output: its masks
against one xgrammar matcher per sample, inline and in worker processes, the states it keeps,
masks applied on the device for the constrained rows only, and its workers' count, share of
the host's cores and failures."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.runtime.config import StructuredOutput

pytest.importorskip("xgrammar")
runner = CliRunner()


def test_a_bad_worker_count_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_GRAMMAR_WORKERS", "many")
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "x", "structured_outputs": {"regex": "a+"}}) + "\n")
    res = runner.invoke(app, ["generate", str(src), "-o", str(tmp_path / "o.jsonl"),
                              "--device", "cpu"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "PAGEDGEN_GRAMMAR_WORKERS='many': give a count, 0 for inline" in \
        " ".join(res.output.split())


@pytest.mark.process
def test_a_dead_worker_is_a_one_line_error():
    """A worker killed (say, by the kernel's OOM killer) stops the run with a line that says
    which and how to run without workers, not a hang."""
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import Grammars

    g = Grammars(ByteTokenizer(), 300, workers=2)
    states = [g.state(StructuredOutput("regex", "[ab]+c")) for _ in range(2)]
    g.apply(torch.zeros(2, 300), [(i, s, [ord("a")]) for i, s in enumerate(states)])
    g.pool._procs[1].kill()
    g.pool._procs[1].wait()  # dead before the next step's tokens go to it
    with pytest.raises(PagedgenError, match=r"grammar worker 1 died \(exit code -9\); .*"
                       "PAGEDGEN_GRAMMAR_WORKERS=0"):
        g.apply(torch.zeros(2, 300), [(i, s, [ord("a")] * 2) for i, s in enumerate(states)])
    g.pool.close()


def _host_processes(inbox):  # a -dp worker's target: what it was told of its host's share
    import os

    yield os.environ.get("PAGEDGEN_HOST_PROCESSES")


@pytest.mark.process
def test_grammar_workers_take_this_processs_share_of_the_cores(monkeypatch):
    """One grammar worker a two cores past two, 1 to 8, of the cores this process shares
    with pagedgen's other processes on the host: the -dp / -tp workers it starts are told
    how many they are, torchrun's ranks read LOCAL_WORLD_SIZE."""
    import os

    from pagedgen.runtime.drivers.launch import Workers
    from pagedgen.runtime.sampling import structured

    monkeypatch.delenv("PAGEDGEN_HOST_PROCESSES", raising=False)
    with Workers(_host_processes, [(), ()], [None, None]) as w:
        assert sorted(m for _, m in w.messages()) == ["2", "2"]
    assert "PAGEDGEN_HOST_PROCESSES" not in os.environ
    monkeypatch.delenv("PAGEDGEN_GRAMMAR_WORKERS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(structured.torch.cuda, "is_available", lambda: True)
    from pagedgen.runtime import hardware  # the cores this process may use

    monkeypatch.setattr(hardware, "usable_cores", lambda: 16)
    assert structured.default_workers() == 7
    monkeypatch.setattr(hardware, "usable_cores", lambda: 64)
    assert structured.default_workers() == 8
    monkeypatch.setenv("PAGEDGEN_HOST_PROCESSES", "8")
    assert structured.default_workers() == 3
    monkeypatch.delenv("PAGEDGEN_HOST_PROCESSES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert structured.default_workers() == 1
    monkeypatch.setenv("PAGEDGEN_GRAMMAR_WORKERS", "0")
    assert structured.default_workers() == 0


def test_masks_apply_on_the_device_for_the_constrained_rows_only():
    """``Grammars.apply`` against a plain loop over the rows (CPU tensors here; the GPU test
    runs the same on CUDA logits)."""
    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import Grammars

    g = Grammars(ByteTokenizer(), 300)
    states = [g.state(StructuredOutput("regex", "[ab]c")), g.state(StructuredOutput(
        "choice", '["x", "yz"]'))]
    logits = torch.randn(4, 300)
    ref = logits.clone()
    g.apply(logits, [(1, states[0], [ord("a")]), (3, states[1], [])])
    assert torch.equal(logits[[0, 2]], ref[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("c")]
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [ord("x"), ord("y")]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.process
def test_the_pool_keeps_each_state_as_its_matcher_would(workers):
    """A token outside the grammar is a refusal; a stop token ends its state as the matcher
    terminates; the next masks follow the tokens taken, filled ahead from a step's tokens."""
    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import Grammars

    tok = ByteTokenizer()
    g = Grammars(tok, 300, workers=workers)
    eos = next(iter(tok.eos_token_ids))
    ok, bad, done = (g.state(StructuredOutput("regex", "[ab]c")) for _ in range(3))
    logits = torch.zeros(3, 300)
    g.apply(logits, [(0, ok, []), (1, bad, []), (2, done, [ord("a"), ord("c")])])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [eos]
    g.prefetch([(ok, 0), (bad, 0), (done, 2)], torch.tensor([ord("b"), ord("z"), eos]), None)
    g.tokens_known()
    g.pool.join()
    assert (ok.active, bad.rejected, done.ended) == (True, True, True)
    assert g.rejected == 1
    allowed = [t for t in range(300) if int(g.pool.masks[ok.slot, t >> 5]) >> (t & 31) & 1]
    assert allowed == [ord("c")]
    logits = torch.zeros(2, 300)
    g.apply(logits, [(0, ok, [ord("b")]), (1, bad, [ord("z")])])  # the pool's mask, as it is
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("c")]
    assert torch.isfinite(logits[1]).all()  # a refused state is left unconstrained
    assert g.prefetched_rows == 1
    g.pool.close()


@pytest.mark.parametrize("workers", [0, 3])
@pytest.mark.process
def test_pool_masks_equal_a_matcher_per_sample(workers):
    """The pool (inline, and in three worker processes) step by step against one xgrammar
    matcher per sample kept here: the same masks, ends and refusals, with samples that skip
    steps (their masks must outlive the buffer's growth), samples released and their slots
    reused."""
    import xgrammar as xgr

    from pagedgen.runtime.models.tokenizer import ByteTokenizer
    from pagedgen.runtime.sampling.structured import Grammars

    tok = ByteTokenizer()
    specs = [StructuredOutput("regex", r"[a-c]{2,6}x"), StructuredOutput("choice", '["yes", "no"]'),
             StructuredOutput("json", '{"type":"integer","minimum":0,"maximum":999}')]
    g = Grammars(tok, 300, workers=workers)
    states, refs = [], []

    def add(k: int) -> None:
        for i in range(k):
            states.append(g.state(specs[i % 3]))
            refs.append([xgr.GrammarMatcher(g.compile(specs[i % 3])), True])  # matcher, live

    add(40)
    gen = torch.Generator().manual_seed(0)
    outs: dict[int, list[int]] = {}
    want = torch.empty(1, g.words, dtype=torch.int32)
    checked = 0
    for step in range(10):
        if step == 3:
            add(40)  # more samples than the first buffer's 64 slots: it grows
        if step == 6:  # a few finish; new ones take their slots
            for i in range(0, 80, 7):
                g.release(states[i])
                refs[i][1] = False
            add(12)
        rows = [(i, st, outs.setdefault(i, [])) for i, st in enumerate(states)
                if refs[i][1] and (i + step) % 5]  # every fifth sits this step out
        logits = torch.rand(len(states), 300, generator=gen)
        g.apply(logits, rows)
        toks = logits.argmax(1)
        toks[1] = ord("z")  # refused by row 1's choice
        for i, _st, out in rows:
            m = refs[i][0]
            m.fill_next_token_bitmask(want)
            allowed = [t for t in range(300) if int(want[0, t >> 5]) >> (t & 31) & 1]
            assert torch.isfinite(logits[i]).nonzero().flatten().tolist() == allowed, (step, i)
            checked += 1
            out.append(int(toks[i]))
            refs[i][1] = m.accept_token(out[-1]) and not m.is_terminated()
        g.prefetch([(st, len(out) - 1) for _, st, out in rows],
                   torch.tensor([out[-1] for _, _, out in rows]), None)
        g.tokens_known()
    g.pool.join()
    assert checked > 300 and g.pool._capacity == 128
    live = [st.active for i, st in enumerate(states) if refs[i][1] or i % 7 or i >= 80]
    assert live == [r[1] for i, r in enumerate(refs) if r[1] or i % 7 or i >= 80]
    assert g.rejected >= 1 and any(st.ended for st in states)
    g.pool.close()
