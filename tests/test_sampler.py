"""Sampling: greedy, top-k, top-p, and reproducibility independent of batch composition."""

from __future__ import annotations

import pytest
import torch

from pagedgen.runtime.sampling.sampler import SamplingBatch, sample, uniform_noise


def batch(n, temp=1.0, top_k=0, top_p=1.0, seeds=None, steps=None):
    return SamplingBatch.build([temp] * n, [top_k] * n, [top_p] * n,
                               seeds or list(range(n)), steps or [0] * n, torch.device("cpu"))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, batch(5, temp=0.0)), logits.argmax(-1))


def test_noise_is_uniform_and_a_function_of_seed_and_step():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 20000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])
    again = uniform_noise(torch.tensor([2]), torch.tensor([0]), 20000)
    assert torch.equal(again[0], u[1])


def test_a_request_samples_the_same_tokens_whatever_its_batch():
    logits = torch.randn(4, 100)
    alone = sample(logits[2:3], batch(1, seeds=[7], steps=[3]))
    together = sample(logits, batch(4, seeds=[1, 2, 7, 9], steps=[0, 0, 3, 5]))
    assert together[2] == alone[0]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    toks = sample(logits, batch(4000, seeds=list(range(4000))))
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2000, 1)
    k2 = sample(logits, batch(2000, top_k=2, seeds=list(range(2000))))
    assert set(k2.tolist()) == {0, 1}
    p = sample(logits, batch(2000, top_p=0.65, seeds=list(range(2000))))
    assert set(p.tolist()) == {0, 1}  # 0.4 < 0.65 <= 0.4 + 0.3
    tiny_p = sample(logits[:50], batch(50, top_p=0.01, seeds=list(range(50))))
    assert set(tiny_p.tolist()) == {0}


def test_noise_never_rounds_to_one():
    """Seed 0, step 26 draws 2**32 - 71 for token 82,727: within 2**-25 of 1, which float32
    rounded to 1.0 (an infinite Gumbel draw: a uniformly random token, or NaN on a masked
    token). Its row, and a masked row sampled with it, stay finite and in the mask."""
    u = uniform_noise(torch.tensor([0]), torch.tensor([26]), 1 << 17)
    assert u.max() < 1 and torch.isfinite(-torch.log(-torch.log(u))).all()
    logits = torch.full((1, 1 << 17), float("-inf"))
    logits[0, :10] = 0.0
    assert sample(logits, batch(1, seeds=[0], steps=[26])).item() < 10


@pytest.mark.kernels
def test_fused_kernel_samples_what_the_torch_path_samples():
    """The one-pass Triton kernel (interpreter on CPU): the same tokens as the torch chain for
    greedy and tempered rows, min-p, seeds, steps, and a vocabulary that is not a multiple of
    its block (the noise is bit-identical; only float32 near-ties could differ, and these
    logits have none)."""
    import importlib.util
    import os
    if importlib.util.find_spec("triton") is None or (
            not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"):
        import pytest
        pytest.skip("needs triton (on CPU under TRITON_INTERPRET=1)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    for v, min_p in ((5000, None), (4099, 0.05), (300, None)):
        n = 9
        logits = (torch.randn(n, v, generator=g) * 3).to(dev)
        temps = [1.0, 0.7, 0.0, 2.0, 1.0, 0.5, 1.3, 0.0, 0.9]
        sb = SamplingBatch.build(temps, [0] * n, [1.0] * n, [3 * i + 1 for i in range(n)],
                                 [0, 5, 9, 1, 2, 3, 100, 4, 7], dev,
                                 min_ps=[min_p] * n if min_p else None)
        assert sample(logits, sb, fused=True).tolist() == sample(logits, sb, fused=False).tolist()


@pytest.mark.kernels
def test_model_dtype_logits_sample_what_their_float32_copy_samples():
    """A step's logits come in the model's dtype (``compute_logits(float32=False)``): greedy
    rows and the fused kernel read them as they are, every other path upcasts first. Each path
    picks from bf16 and fp16 logits exactly what it picks from their float32 copy (over 256
    rows of close logits, where tempering in 16 bits would flip some rows' picks)."""
    import importlib.util
    import os
    fused_ok = importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(3)
    n, v = 256, 257
    temps = [0.0, 1.0, 0.7, 1.3] * (n // 4)
    settings = {"greedy": dict(temps=[0.0] * n), "tempered": {}, "top_k": dict(top_k=20),
                "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.05)}
    for dtype in (torch.bfloat16, torch.float16):
        logits = torch.randn(n, v, generator=g).to(dtype).to(dev)
        for name, s in settings.items():
            sb = SamplingBatch.build(s.get("temps", temps), [s.get("top_k", 0)] * n,
                                     [s.get("top_p", 1.0)] * n, list(range(n)), [2] * n, dev,
                                     min_ps=[s["min_p"]] * n if "min_p" in s else None)
            # the kernel's paths (once: the interpreter is slow; it reads fp16 as bf16)
            kernel = fused_ok and name in ("tempered", "min_p") and dtype == torch.bfloat16
            for fused in ((False, True) if kernel else (False,)):
                want = sample(logits.float(), sb, fused=fused).tolist()
                assert sample(logits, sb, fused=fused).tolist() == want, (dtype, name, fused)


def test_a_bf16_engine_samples_from_bf16_logits_as_it_would_from_float32(monkeypatch):
    """The engine asks the model for logits in its dtype (no [rows, vocab] float32 copy a
    step): a bf16 run keeps them in bf16 where nothing changes them, and its tokens and
    log-probabilities (greedy, tempered, top-k, with and without penalties) are those of the
    same run handed float32 logits."""
    from pagedgen.runtime.config import EngineConfig, SamplingParams
    from pagedgen.runtime.engine.engine import Engine

    prompts = [[256, 72, 101, 108], [256, 87, 111], [256, 1, 2, 3, 4, 5]]
    params = [SamplingParams(max_tokens=8, temperature=t, top_k=k, seed=5, ignore_eos=True,
                             logprobs=2, presence_penalty=pp)
              for t, k, pp in ((0.0, 0, 0.0), (1.0, 0, 0.0), (0.8, 5, 0.0), (1.0, 0, 0.4))]

    def run(float32: bool):
        eng = Engine(EngineConfig(model="tiny", device="cpu", dtype="bfloat16", num_blocks=64,
                                  max_num_seqs=8))
        if float32:
            real = eng.runner.model.compute_logits
            monkeypatch.setattr(eng.runner.model, "compute_logits",
                                lambda h, float32=True: real(h, True))
        seqs = [eng.add_request(p, sp) for sp in params for p in prompts]
        dtypes = set()
        while eng.has_unfinished():
            eng.step()
            if eng.runner.last_logits is not None:
                dtypes.add(eng.runner.last_logits.dtype)
        return ([s.output_token_ids for s in seqs],
                [s.logprobs for s in seqs], dtypes)

    tokens, lps, dtypes = run(False)
    assert dtypes == {torch.bfloat16, torch.float32}  # float32 only where penalties applied
    want_tokens, want_lps, want_dtypes = run(True)
    assert want_dtypes == {torch.float32}
    assert tokens == want_tokens and lps == want_lps
