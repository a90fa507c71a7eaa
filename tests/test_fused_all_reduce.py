"""The push all-reduce, alone and fused with the residual add and RMSNorm after it (issues
36, 62): the kernel's arithmetic against the unfused chain and its slot bookkeeping (Triton
interpreter, local tensors as the peers' buffers, the peers' pushes written beforehand), the
chain over gloo against the sum computed by hand, and which layers of a sharded model leave
their all-reduce to the norm after them."""

from __future__ import annotations

import os

import pytest
import torch
from hf_models import make_checkpoint

from pagedgen.runtime.collectives import fused_all_reduce as far
from pagedgen.runtime.collectives.parallel import TensorParallel
from pagedgen.runtime.drivers.launch import Workers
from pagedgen.runtime.layers import fused_ops
from pagedgen.runtime.layers.moe.layer import SparseMoeBlock
from pagedgen.runtime.models.loader import build_model, resolve_model

INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not far.HAVE_TRITON,
    reason="Triton kernels run on CPU tensors only when interpreted")


def _parts(world: int, rows: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, n, generator=g).to(dtype) for _ in range(world)]
    for p in partials:  # zeros of both signs: -0.0 is the "empty" mark, never sent
        p.view(-1)[::7] = 0.0
        p.view(-1)[3::7] = -0.0
    residual = torch.randn(rows, n, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    return partials, residual, weight


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _positive_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t == 0, torch.zeros_like(t), t)


def _ranks(world: int, dtype: torch.dtype, cap: int, step: int = 0):
    """Every rank's push buffer (local tensors as the peers' memory) and rank 0's view."""
    buffers = [far.PushBuffer.empty_(torch.empty(far.SLOTS * world * cap, dtype=dtype))
               for _ in range(world)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    return buffers, far.PushBuffer(buffers[0], peers, 0,
                                   torch.tensor([step, 0], dtype=torch.int32), cap,
                                   owner=buffers)


def _peers_pushed(buf: far.PushBuffer, partials: list[torch.Tensor], slot: int) -> None:
    """Write the peers' partials into rank 0's slot, as their kernels would."""
    world = buf.peers.numel()
    for p in range(1, world):
        at = (slot * world + p) * buf.cap
        buf.mine[at:at + partials[p].numel()] = _positive_zeros(partials[p]).view(-1)


@INTERPRETED
@pytest.mark.parametrize("world,rows,n,dtype", [
    (1, 3, 32, torch.float32), (2, 5, 64, torch.float32), (4, 300, 96, torch.float16),
    (8, 7, 40, torch.float16)])  # 300 rows: programs loop over rows; 40: a partial block
# (not bfloat16: the interpreter's float32 -> bfloat16 truncates where a GPU rounds)
@pytest.mark.kernels
def test_push_kernel_equals_the_all_reduce_then_the_norm(world, rows, n, dtype):
    partials, residual, weight = _parts(world, rows, n, dtype)
    _, buf = _ranks(world, dtype, cap=rows * n + 5, step=4)  # slot 1
    _peers_pushed(buf, partials, slot=1)
    out, res = far.push_all_reduce(buf, partials[0], residual=residual, weight=weight,
                                   eps=1e-6)
    want_out, want_res = far.add_rms_norm_reference(partials, residual, weight, 1e-6)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want_out, atol=1e-6 if dtype == torch.float32 else 1e-3,
                               rtol=1e-5)
    ref_out, ref_res = fused_ops.rms_norm_ref(want_res - residual, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref_out, atol=1e-3, rtol=1e-3)  # the norm the model uses


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.kernels
def test_push_kernel_writes_each_peer_and_leaves_its_own_slot_empty(dtype):
    """Rank 0's rows land in every peer's slot (its region, -0.0 sent as +0.0), its own slot is
    emptied as read, nothing else is touched, and the step counter turns once."""
    world, rows, n, cap = 3, 4, 16, 80
    partials, _, _ = _parts(world, rows, n, dtype, seed=1)
    buffers, buf = _ranks(world, dtype, cap, step=2)  # slot 2
    _peers_pushed(buf, partials, slot=2)
    out = far.push_all_reduce(buf, partials[0])
    want = torch.stack([p.float() for p in partials]).sum(0).to(dtype)
    assert torch.equal(out, want)
    empty = far.PushBuffer.empty_(torch.empty(far.SLOTS * world * cap, dtype=dtype))
    assert torch.equal(_bits(buf.mine), _bits(empty))  # read, then emptied
    sent = _bits(_positive_zeros(partials[0])).view(-1)
    for p in (1, 2):
        at = (2 * world + 0) * cap
        got = _bits(buffers[p])
        assert torch.equal(got[at:at + rows * n], sent)
        rest = torch.cat([got[:at], got[at + rows * n:]])
        assert torch.equal(rest, _bits(empty)[:rest.numel()])
    assert buf.counter.tolist() == [3, 0]


@INTERPRETED
@pytest.mark.kernels
def test_push_kernel_turns_its_slots_and_sums_in_place():
    """Calls of changing row counts take slots 0, 1, 2, 0: each reads only its own turn."""
    world, n, cap = 2, 32, 200
    _, buf = _ranks(world, torch.float32, cap)
    for call, rows in enumerate([3, 6, 1, 5]):
        partials, _, _ = _parts(world, rows, n, torch.float32, seed=call)
        _peers_pushed(buf, partials, slot=call % far.SLOTS)
        x = partials[0].clone()
        assert far.push_all_reduce(buf, x, out=x) is x
        torch.testing.assert_close(x, partials[0] + partials[1], rtol=0, atol=0)
        assert buf.counter.tolist() == [call + 1, 0]


def test_push_kernel_refuses_what_does_not_fit():
    _, buf = _ranks(2, torch.float32, cap=64)
    with pytest.raises(ValueError, match="does not fit the push buffer"):
        far.push_all_reduce(buf, torch.zeros(5, 16))
    with pytest.raises(ValueError, match="does not fit the push buffer"):
        far.push_all_reduce(buf, torch.zeros(2, 16, dtype=torch.float16))
    nine = far.PushBuffer(buf.mine, buf.peers.repeat(5)[:9], 0, buf.counter, 64)
    with pytest.raises(ValueError, match="1 to 8 ranks, not 9"):
        far.push_all_reduce(nine, torch.zeros(2, 16))


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


@pytest.mark.process
def test_the_chain_over_gloo_sums_every_ranks_partials():
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


def test_an_all_reduce_kind_that_does_not_exist_is_a_one_line_error(monkeypatch):
    from pagedgen.errors import PagedgenError
    monkeypatch.setenv("PAGEDGEN_ALL_REDUCE", "ring")
    with pytest.raises(PagedgenError, match="PAGEDGEN_ALL_REDUCE=ring: expected one of push, "
                                            "one-shot, nccl"):
        TensorParallel(0, 2).enable_one_shot(torch.float32, torch.device("cpu"))
    monkeypatch.setenv("PAGEDGEN_ALL_REDUCE", "nccl")
    tp = TensorParallel(0, 2)
    tp.enable_one_shot(torch.float32, torch.device("cpu"))  # the CPU: gloo, nothing to set up
    assert tp.push is None and tp.all_reduce_kind == "nccl"
