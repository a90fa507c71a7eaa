"""Expert parallel (``-tp 2 --expert-parallel``): each rank holds half the experts whole (their
weights, biases, FP8 or MXFP4 scales), the others' tokens weigh nothing there and the ranks'
outputs are summed as under tensor parallel: the greedy trace over two gloo ranks equals one
rank's, from checkpoints and from dummy weights, on the CPU's loop and in the grouped GEMM
kernels (Triton's interpreter)."""

from __future__ import annotations

import pytest
from fp8_checkpoints import write_fp8
from hf_models import make_checkpoint
from test_fp8 import PROMPTS, config
from test_moe import INTERPRETED_ONLY

from pagedgen.cli.verify.model_checks import compare, trace, trace_worker
from pagedgen.errors import PagedgenError
from pagedgen.runtime.drivers.launch import Workers
from pagedgen.runtime.engine.engine import Engine


def _ep_trace(model: str, steps: int = 4, **kw):
    """(one rank's greedy trace, two expert-parallel ranks')."""
    cfg = config(model, tensor_parallel_size=2, expert_parallel=True, **kw)
    with Workers(trace_worker, [(cfg, PROMPTS, steps, None)], [None], tp=2) as w:
        sharded = [msg for _, msg in w.messages()][0]
    return trace(Engine(config(model, **kw)), PROMPTS, steps), sharded


def _assert_same(ref, sharded, label: str) -> None:
    row = compare(ref, sharded, 1e-5, label)
    assert row.worst_abs < 1e-4 and sharded[1] == ref[1], (label, row)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"])
@pytest.mark.process
def test_two_expert_parallel_ranks_give_one_ranks_trace(kind, tmp_path):
    """Per-expert checkpoint names (Qwen3-MoE, Mixtral), stacked and biased experts
    (gpt-oss), a shared expert beside them split by width (Qwen2-MoE)."""
    ckpt = str(make_checkpoint(kind, tmp_path / kind))
    _assert_same(*_ep_trace(ckpt), kind)


@pytest.mark.process
def test_fp8_experts_and_dummy_weights_split_by_expert(tmp_path):
    dense = make_checkpoint("qwen3_moe", tmp_path / "dense")
    _assert_same(*_ep_trace(str(write_fp8(dense, tmp_path / "q", "hf-block", block=(16, 16)))),
                 "fp8")
    _assert_same(*_ep_trace(str(dense), load_format="dummy"), "dummy")


def _kernels_trace_worker(cfg, prompts, steps, inbox):
    """``trace_worker`` with every MoE layer in the grouped GEMM kernels."""
    from pagedgen.runtime.layers.moe.layer import FusedMoE
    eng = Engine(cfg)
    for m in eng.runner.model.modules():
        if isinstance(m, FusedMoE):
            m.use_triton = True
    logits, outputs = trace(eng, prompts, steps)
    yield {k: v.numpy() for k, v in logits.items()}, outputs


@INTERPRETED_ONLY
@pytest.mark.process
def test_expert_parallel_in_the_grouped_gemm_kernels(tmp_path):
    """Slots of the other rank's experts sorted into a dropped expert's blocks, which return at
    once and add nothing."""
    ckpt = str(make_checkpoint("gpt_oss", tmp_path / "gpt_oss"))
    cfg = config(ckpt, tensor_parallel_size=2, expert_parallel=True)
    with Workers(_kernels_trace_worker, [(cfg, PROMPTS, 3)], [None], tp=2) as w:
        sharded = [msg for _, msg in w.messages()][0]
    _assert_same(trace(Engine(config(ckpt)), PROMPTS, 3), sharded, "kernels")


def test_expert_parallel_without_tensor_parallel_is_a_one_line_error():
    with pytest.raises(PagedgenError, match="--expert-parallel splits .* give -tp 2 or more"):
        config("tiny", expert_parallel=True).validate()
