"""Gated DeltaNet on a GPU (issue 60): our Triton kernels compiled and flash-linear-attention's
chunked prefill against the torch reference (bf16 and fp32), and a hybrid model's decode
through CUDA graphs (the same tokens as eager steps; prefill logits near transformers')."""

from __future__ import annotations

import pytest
import torch
from test_gated_delta import SPEC, STEPS, _steps

from pagedgen.attention.recurrent.gated_delta import GatedDeltaKernels, chunked_unavailable
from pagedgen.attention.recurrent.state import GatedDeltaSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
# long prompts over many 64-token chunks, beside decodes, from states and from zero (the
# convolution's blocks inside a prompt and across its start)
LONG = STEPS + [([(4, 0, 900), (0, 12, 300)], [(1, 5), (2, 3)])]


WIDE = GatedDeltaSpec(num_k_heads=2, num_v_heads=4, head_k=128, head_v=128, conv_kernel=4)


@pytest.mark.parametrize("prefill", ["triton", "fla", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernels_equal_the_reference(prefill, dtype):
    spec = WIDE if prefill == "flashinfer" else SPEC  # FlashInfer's: heads of 128, bf16
    why = prefill != "triton" and chunked_unavailable(prefill, CUDA, (spec,), dtype)
    if why:
        pytest.skip(why)
    want, ref = _steps(GatedDeltaKernels("torch", "torch"), dtype, LONG, CUDA, spec)
    got, state = _steps(GatedDeltaKernels("triton", prefill), dtype, LONG, CUDA, spec)
    # ours: float32 arithmetic throughout; the chunked kernels: tensor-core products
    tol = dict(atol=4e-2, rtol=4e-2) if dtype == torch.bfloat16 else \
        dict(atol=1e-2, rtol=1e-2) if prefill == "fla" else dict(atol=2e-3, rtol=2e-3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.float(), w.float(), **tol)
    torch.testing.assert_close(state.ssm[:5].float(), ref.ssm[:5].float(), **tol)
    torch.testing.assert_close(state.conv[:5].float(), ref.conv[:5].float(), **tol)


def test_hybrid_decode_through_cuda_graphs_equals_eager_and_transformers(tmp_path):
    """The state slots indexed inside CUDA graphs (padding rows on the scratch slot): the
    greedy tokens of eager steps (kernels may split work by batch size, so a near-tie may
    turn late: a wrong slot turns every token from the first decode on); prefill logits near
    transformers' (fp16 here, fp32 there)."""
    from hf_models import make_checkpoint
    from test_hf_equivalence import hf_model, ids, prefill_logits

    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    path = make_checkpoint("qwen3_5_moe_text", tmp_path / "m", head_dim=64)  # triton: >= 64
    prompts = [ids(n, seed) for seed, n in enumerate((5, 17, 9, 70, 33))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = []
    for eager in (False, True):  # a fixed KV cache: the first engine lives while the second
        # is built, and sized by free memory the second found none (0 blocks)
        eng = Engine(EngineConfig(model=str(path), device="cuda", dtype="float16",
                                  backend="triton", max_num_seqs=8, block_size=16,
                                  max_num_batched_tokens=256, enforce_eager=eager,
                                  num_blocks=128))
        assert (eng.runner.graphs is None) == eager
        runs.append([s.output_token_ids for s in eng.generate(prompts, params)])
    same = [a == b for graph, eager in zip(*runs) for a, b in zip(graph, eager)]
    assert all(g[:4] == e[:4] for g, e in zip(*runs)) and sum(same) >= 0.9 * len(same)
    with torch.no_grad():
        # on the GPU: transformers runs flash-linear-attention's kernels where it is installed
        want = hf_model(path).to(CUDA)(torch.tensor([prompts[3]], device=CUDA)).logits[0].cpu()
    got = prefill_logits(eng, prompts[3], 32).cpu()
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
