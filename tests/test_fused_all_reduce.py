"""The all-reduce fused with the residual add and RMSNorm after it (issue 36): the kernel's
arithmetic against the unfused chain (Triton interpreter, local tensors as the peers' buffers,
no barrier), the chain over gloo against the sum computed by hand, and which layers of a
sharded model leave their all-reduce to the norm after them."""

from __future__ import annotations

import os

import pytest
import torch

from hf_models import make_checkpoint
from pagedgen.runtime.collectives import fused_all_reduce as far
from pagedgen.runtime.drivers.launch import Workers
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.moe import SparseMoeBlock
from pagedgen.runtime.models.loader import build_model, resolve_model

INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not far.HAVE_TRITON,
    reason="Triton kernels run on CPU tensors only when interpreted")


def _parts(world: int, rows: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, n, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    return partials, residual, weight


@INTERPRETED
@pytest.mark.parametrize("world,rows,n,dtype", [
    (1, 3, 32, torch.float32), (2, 5, 64, torch.float32), (4, 300, 96, torch.float16),
    (8, 7, 40, torch.float16)])  # 300 rows: programs loop over rows; 40: a partial block
def test_fused_kernel_equals_the_all_reduce_then_the_norm(world, rows, n, dtype):
    partials, residual, weight = _parts(world, rows, n, dtype)
    out, res = far.one_shot_add_rms_norm(partials, residual, weight, 1e-6, rank=0)
    want_out, want_res = far.add_rms_norm_reference(partials, residual, weight, 1e-6)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want_out, atol=1e-6 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5)
    ref_out, ref_res = fused_ops.rms_norm_ref(want_res - residual, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-3, rtol=1e-3)  # the norm the model uses


def test_fused_kernel_refuses_more_ranks_than_it_reads():
    partials, residual, weight = _parts(1, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="1 to 8 ranks, not 9"):
        far.one_shot_add_rms_norm(partials * 9, residual, weight, 1e-6, rank=0)


def _chain_worker(inbox):
    """Each rank's partial sums (seeded by rank) through ``all_reduce_add_rms_norm``."""
    from pagedgen.runtime.collectives import parallel
    tp = parallel.current()
    g = torch.Generator().manual_seed(100 + tp.rank)
    partial = torch.randn(6, 32, generator=g)
    residual = torch.randn(6, 32, generator=torch.Generator().manual_seed(7))
    weight = torch.full((32,), 0.5)
    out, res = tp.all_reduce_add_rms_norm(partial.clone(), residual, weight, 1e-6,
                                          fused_ops.rms_norm_ref)
    yield out.numpy(), res.numpy(), {k: os.environ.get(k) for k in parallel.NO_MULTICAST}


def test_the_chain_over_gloo_sums_every_ranks_partials(monkeypatch):
    monkeypatch.setenv(far.ENV, "1")  # asked for, but gloo has no symmetric memory: unfused
    with Workers(_chain_worker, [()], [None], tp=2) as w:
        (out, res, env), = [msg for _, msg in w.messages()]
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}  # NVLink multicast off in every rank
    partials = [torch.randn(6, 32, generator=torch.Generator().manual_seed(100 + r))
                for r in range(2)]
    residual = torch.randn(6, 32, generator=torch.Generator().manual_seed(7))
    want_out, want_res = far.add_rms_norm_reference(partials, residual, torch.full((32,), 0.5),
                                                    1e-6)
    torch.testing.assert_close(torch.from_numpy(res), want_res)
    torch.testing.assert_close(torch.from_numpy(out), want_out)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_sharded_models_leave_each_all_reduce_to_the_norm_after_it(kind, tmp_path):
    """o_proj → post-attention norm; a dense MLP's down_proj, or a MoE block, → the next
    layer's input norm (or the final norm) (tests/test_tensor_parallel.py and test_moe.py
    check the logits)."""
    path = make_checkpoint(kind, tmp_path / kind)
    model = build_model(resolve_model(str(path)), "safetensors", torch.float32,
                        torch.device("cpu"), tp=TensorParallel(0, 2))
    model.defer_all_reduces()
    layers = list(model.model.layers)
    after = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
    assert layers[0].input_layernorm.reduce is None  # the embedding is whole already
    for layer, norm in zip(layers, after):
        assert layer.self_attn.o_proj.defer_reduce
        assert layer.post_attention_layernorm.reduce is model.tp
        assert norm.reduce is model.tp
        moe = isinstance(layer.mlp, SparseMoeBlock)
        assert (layer.mlp if moe else layer.mlp.down_proj).defer_reduce
    if kind == "qwen3_moe":  # its layer 1 is dense (mlp_only_layers), the others MoE
        assert [isinstance(m.mlp, SparseMoeBlock) for m in layers] == [True, False, True]
    single = build_model(resolve_model(str(path)), "safetensors", torch.float32,
                         torch.device("cpu"))
    single.defer_all_reduces()  # one rank: nothing to defer
    assert not any(getattr(m, "defer_reduce", False) for m in single.modules())
