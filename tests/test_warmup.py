"""The start-up warm-up (``runtime/worker/warmup.py``): its steps take prefills alone,
prefills beside decodes and decodes alone; the run after it is the run without it (tokens,
seeds, counters, graph captures); it fits a small context; the caller's logits processors are
not asked for its requests. (On by default on CUDA only; forced on here.)"""

from __future__ import annotations

from types import SimpleNamespace

from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.worker import warmup
from pagedgen.runtime.worker.model_runner import ModelRunner
from tests.test_engine import GREEDY, prompts, tiny

SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # seeded by number


def test_the_warm_up_steps_prefills_alone_beside_decodes_and_decodes_alone(monkeypatch):
    shapes = []
    forward = ModelRunner.forward

    def counted(self, batch):
        shapes.append((len(batch.prefills), len(batch.decodes)))
        return forward(self, batch)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    eng = tiny(startup_warmup=True, max_num_batched_tokens=1024)
    first, second = len(warmup.FIRST[0]), len(warmup.SECOND[0])
    assert shapes[:2] == [(first, 0), (second, first)]
    assert (0, first + second) in shapes
    assert eng.startup_phases["warmup"] > 0
    assert not eng.has_unfinished()


def test_a_run_after_the_warm_up_is_the_run_without_it():
    ps = prompts(6)
    runs = []
    for warm in (False, True):
        eng = tiny(startup_warmup=warm)
        seqs = eng.generate(ps, SAMPLED) + eng.generate(ps, GREEDY)
        st = eng.stats
        runs.append(([(s.seq_id, s.output_token_ids) for s in seqs], st.num_steps,
                     st.prefill_tokens, st.decode_tokens, st.requests_finished,
                     st.prefix_hit_tokens))
    assert runs[1] == runs[0]


def test_the_warm_up_fits_a_small_context_and_cache():
    eng = tiny(startup_warmup=True, max_model_len=24, num_blocks=8, block_size=4,
               max_num_seqs=2, max_num_batched_tokens=16)
    assert eng.stats.num_steps == 0 and eng.startup_phases["warmup"] > 0
    assert len(eng.generate(prompts(2, 3, 6), GREEDY)[0].output_token_ids) == 16


def test_graphs_captured_in_a_run_count_from_the_last_reset():
    """The warm-up's (or a benchmark's earlier run's) graph captures are not the next run's."""
    eng = tiny(startup_warmup=False)
    eng.runner.graphs = SimpleNamespace(run_captures=3, run_capture_s=1.5, run_warmups=2)
    eng.reset_stats()
    g = eng.runner.graphs
    assert (g.run_captures, g.run_capture_s, g.run_warmups) == (0, 0.0, 0)


def test_the_callers_logits_processors_are_not_asked_for_the_warm_ups_requests():
    asked = []
    eng = Engine(EngineConfig(device="cpu", backend="sdpa", load_format="dummy", max_num_seqs=8,
                              max_num_batched_tokens=256, startup_warmup=True),
                 processor_factory=lambda request, params, i: asked.append(request) or [])
    assert asked == [] and eng.processor_factory is not None
    eng.generate(prompts(2), GREEDY)
    assert len(asked) == 2
