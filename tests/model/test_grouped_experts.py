"""Grouped-GEMM experts (moe_rl.model.grouped) against a plain per-expert reference."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.model import MoEArch
from moe_rl.model import grouped as grouped_ops
from moe_rl.model import transformer
from moe_rl.model.transformer import SparseMoE


def make_moe(num_experts=8, top_k=3, hidden=32, inter=16, dtype=torch.float32, seed=0):
    arch = MoEArch(vocab_size=40, hidden_size=hidden, num_hidden_layers=1, num_experts=num_experts,
                   num_experts_per_tok=top_k, moe_intermediate_size=inter, head_dim=8)
    moe = SparseMoE(arch, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe.to(dtype)


def reference(moe, x, replay=None):
    """Every token through its experts one by one, written out plainly."""
    probs = F.softmax(x @ moe.gate.weight.t(), dim=-1, dtype=torch.float)
    if replay is None:
        w, ids = probs.topk(moe.top_k, dim=-1)
    else:
        ids = replay
        w = probs.gather(1, ids)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    ex = moe.experts
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if len(tok):
            xs = x[tok]
            y = (F.silu(xs @ ex.gate_proj[e].t()) * (xs @ ex.up_proj[e].t())) @ ex.down_proj[e].t()
            out = out.index_add(0, tok, y * w[tok, slot, None])
    return out, ids


def fwd_bwd(moe, x, fn, replay=None):
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, ids = fn(moe, x, replay)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out * grad_out).sum().backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    return out.detach(), ids, grads


def grouped(moe, x, replay):
    return moe(x, replay)


@pytest.mark.parametrize("kernel", ["grouped_mm", "padded"])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_replay", [False, True])
def test_grouped_equals_per_expert_reference(monkeypatch, kernel, align, dtype, use_replay):
    """fp32: within 1e-5. bf16: the bf16 model against the fp32 reference on the same (bf16-valued)
    weights, within 2^-6 of each tensor's largest magnitude (the bf16 reference itself is ~0.6% off)."""
    monkeypatch.setattr(transformer, "group_align", lambda x: align)  # the CUDA padding path, on CPU
    if kernel == "padded":  # the float64 fallback
        monkeypatch.setattr(grouped_ops, "grouped_kernel", lambda x, w=None: "padded")
    moe = make_moe(dtype=dtype)
    ref_moe = make_moe(dtype=dtype).float()
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    # expert 5 never chosen under replay: an empty group
    replay = torch.stack([torch.randperm(7, generator=torch.Generator().manual_seed(i))[:3] for i in range(37)])
    replay = torch.where(replay == 5, 7, replay) if use_replay else None
    out, ids, grads = fwd_bwd(moe, x, grouped, replay)
    ref_out, ref_ids, ref_grads = fwd_bwd(ref_moe, x.float(), reference, replay)
    assert torch.equal(ids, ref_ids)
    assert grads.keys() == ref_grads.keys() and len(grads) == 5
    for name, got, want in [("out", out, ref_out)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        else:
            err = (got.float() - want).abs().max()
            assert err <= 2**-6 * want.abs().max(), (name, float(err), float(want.abs().max()))
    if use_replay:
        assert torch.equal(ids, replay) and grads["experts.gate_proj"][5].abs().max() == 0


def test_cutlass_only_where_torch_builds_it(monkeypatch):
    """bf16 on CUDA takes torch._grouped_mm's CUTLASS kernel on sm_90 and sm_100 only (torch's
    `bf16bf16_grouped_gemm_impl_sm90_sm100`); on other GPUs torch falls back to a loop over the
    groups on the host, which a CUDA graph cannot capture, so those take the Triton kernel."""
    from types import SimpleNamespace

    x = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda", 0))  # a CUDA tensor's two attributes
    for cap, want in (((8, 0), "triton"), ((8, 9), "triton"), ((9, 0), "cutlass"), ((10, 0), "cutlass"),
                      ((12, 0), "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert grouped_ops.grouped_kernel(x) == want, cap
        assert grouped_ops.grouped_kernel(SimpleNamespace(dtype=torch.float32, device=x.device)) == "triton"


def test_groups_are_padded_for_cutlass_only(monkeypatch):
    """CUTLASS (bf16 on sm_90/sm_100) wants 16-byte aligned group starts; the Triton kernel (fp32,
    fp16, other GPUs) and the CPU take any start, so their dispatch pads nothing."""
    from types import SimpleNamespace

    def tensor(dtype, device):
        return SimpleNamespace(dtype=dtype, device=torch.device(device),
                               element_size=lambda: torch.empty((), dtype=dtype).element_size())

    for cap, dtype, want in (((9, 0), torch.bfloat16, 8), ((10, 0), torch.bfloat16, 8), ((9, 0), torch.float32, 1),
                             ((9, 0), torch.float16, 1), ((8, 0), torch.bfloat16, 1)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert grouped_ops.group_align(tensor(dtype, "cuda")) == want, (cap, dtype)
    assert grouped_ops.group_align(torch.zeros(2, dtype=torch.bfloat16)) == 1


def test_float64_takes_the_padded_path():
    """torch._grouped_mm's CPU kernel refuses float64; grouped_mm then pads, with the same result
    as a per-group matmul. float32 takes torch's CPU kernel behind moe_rl's custom op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    w = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # group 1 empty
    assert grouped_ops.grouped_kernel(x) == "padded" and grouped_ops.grouped_kernel(x.float()) == "torch"
    want = torch.cat([x[0:2] @ w[0].T, x[2:7] @ w[2].T])
    torch.testing.assert_close(grouped_ops.grouped_mm(x, w, offs), want, rtol=1e-12, atol=1e-12)


def test_replayed_routing_is_bit_identical_to_the_record():
    moe = make_moe(num_experts=16, top_k=4)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    out, rec = moe(x)
    with torch.no_grad():
        moe.gate.weight.add_(torch.randn_like(moe.gate.weight))  # the router would now choose otherwise
    assert not torch.equal(moe(x)[1], rec)
    out2, ids2 = moe(x, rec)
    assert torch.equal(ids2, rec) and ids2.dtype == rec.dtype


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(num_experts: int, replay: bool = False) -> list[str]:
    moe = make_moe(num_experts=num_experts, top_k=4)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    rep = torch.rand(256, num_experts).argsort(1)[:, :4] if replay else None
    with _Count() as c:
        out, _ = moe(x, rep)
        out.square().sum().backward()
    return c.ops


def test_dispatched_ops_do_not_grow_with_num_experts():
    small, large = _ops_of_one_step(8), _ops_of_one_step(64)
    assert abs(len(large) - len(small)) <= 2, (len(small), len(large))
    rs, rl = _ops_of_one_step(8, replay=True), _ops_of_one_step(64, replay=True)
    assert abs(len(rl) - len(rs)) <= 2, (len(rs), len(rl))


@pytest.mark.parametrize("align", [1, 8])
def test_the_backward_adds_nothing_by_index(monkeypatch, align):
    """The grads of the permutation into expert groups and back are gathers (and a sum over
    each token's k rows): index_add / scatter_add / accumulating index_put run on atomic adds on
    a GPU (bf16 ones: 10% of the large train preset's step on an H100, where autograd gave
    index_select's backward as index_add). Router aside: its top-k's backward scatters k values
    per token into the [tokens, experts] probabilities, a different op."""
    monkeypatch.setattr(transformer, "group_align", lambda x: align)
    ops = _ops_of_one_step(8)
    assert not [o for o in ops if "index_add" in o or "scatter_add" in o or "index_put" in o], sorted(set(ops))


def test_forward_backward_has_no_data_dependent_shape_or_host_read():
    """Under FakeTensorMode tensors have no data: .item()/.tolist()/int(t), nonzero or bincount
    (an output size read from the data) raise, so this fails on any host sync in the layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    moe = make_moe(num_experts=16, top_k=4, dtype=torch.bfloat16)  # _grouped_mm's meta kernel is bf16-only
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(256, 32, dtype=torch.bfloat16, requires_grad=True)
        out, ids = moe(x)
        out.float().square().sum().backward()
    assert out.shape == (256, 32) and ids.shape == (256, 4) and moe.experts.down_proj.grad is not None


def _concatenated_gate_up(self, x, offs):
    """Experts.forward as it was: one grouped GEMM over gate and up concatenated per forward."""
    gate_up = grouped_ops.grouped_mm(x, torch.cat((self.gate_proj, self.up_proj), dim=1), offs)
    if self.lora is not None and self.lora.gate_up is not None:
        gate_up = gate_up + self.lora._rows(self.lora.gate_up, x, offs)
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    out = grouped_ops.grouped_mm(h, self.down_proj, offs)
    return out if self.lora is None else self.lora.add_down(out, h, offs)


@pytest.mark.parametrize("lora", [False, True])
def test_separate_gate_and_up_gemms_equal_the_concatenated_weights(monkeypatch, lora):
    """Logits and gradients (the base weights', or with an expert LoRA attached the adapters')
    of the model with two grouped GEMMs (gate, up) equal those of one over [gate; up]."""
    from moe_rl.model import MoEForCausalLM
    from moe_rl.model.lora import LoraAdapters

    arch = MoEArch(vocab_size=53, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2)
    model = MoEForCausalLM(arch).init_weights(0, std=0.1)
    params = model
    if lora:
        params = LoraAdapters(model, 4, 8.0, ["experts.gate_up_proj", "experts.down_proj"]).init_weights(1)
        with torch.no_grad():
            for b in params.B.values():
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    ids = torch.randint(0, 53, (3, 11), generator=torch.Generator().manual_seed(3))

    def run():
        params.zero_grad(set_to_none=True)
        with params.in_forward() if lora else torch.enable_grad():
            logits = model(ids)
            logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}

    logits, grads = run()
    monkeypatch.setattr(transformer.Experts, "forward", _concatenated_gate_up)
    want_logits, want_grads = run()
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys() and any("gate_up" in n or "gate_proj" in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)


class _CatBytes(TorchDispatchMode):
    """Bytes written by aten.cat under this mode."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.bytes += out.numel() * out.element_size()
        return out


def test_a_one_token_forward_of_the_gpu_1x_model_copies_no_expert_weights(monkeypatch):
    """On meta tensors (shapes only) in bf16: what aten.cat writes in one 1-token forward of
    configs/gpu_1x.yaml's model. Concatenating the experts' gate and up weights wrote 512 MiB
    (8 layers x 32 experts x [1024, 1024]), inside every captured decode graph too."""
    from moe_rl.config import load_config
    from moe_rl.model import MoEForCausalLM

    arch = load_config("configs/gpu_1x.yaml").model.arch()
    with torch.device("meta"):
        model = MoEForCausalLM(arch).to(torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.long, device="meta")

    def cat_bytes():
        with torch.no_grad(), _CatBytes() as c:
            assert model(ids).shape == (1, 1, arch.vocab_size)
        return c.bytes

    assert cat_bytes() < 2**20
    monkeypatch.setattr(transformer.Experts, "forward", _concatenated_gate_up)  # the check sees the old copy
    expert_gate_up = arch.num_hidden_layers * arch.num_experts * 2 * arch.moe_intermediate_size * arch.hidden_size * 2
    assert cat_bytes() >= expert_gate_up == 512 * 2**20


def _lora_experts_on_meta(rank: int):
    """Forward and backward of a bf16 MoE layer with an expert LoRA of ``rank`` on meta
    tensors, where torch._grouped_mm checks strides as its CUDA kernel does."""
    from moe_rl.model.lora import ExpertLora

    with torch.device("meta"):
        moe = make_moe(num_experts=8, top_k=2, hidden=32, inter=16).to(torch.bfloat16)
        lora = ExpertLora(scaling=2.0)
        E, I, H = 8, 16, 32
        lora.gate_up = (torch.empty(E, rank, H, dtype=torch.bfloat16, requires_grad=True),
                        torch.empty(E, 2 * I, rank, dtype=torch.bfloat16, requires_grad=True))
        lora.down = (torch.empty(E, rank, I, dtype=torch.bfloat16, requires_grad=True),
                     torch.empty(E, H, rank, dtype=torch.bfloat16, requires_grad=True))
        moe.experts.lora = lora
        x = torch.empty(40, H, dtype=torch.bfloat16, requires_grad=True)
    out, _ = moe(x)
    out.float().sum().backward()
    return [t.grad for t in lora.gate_up + lora.down]


@pytest.mark.parametrize("rank", [4, 8, 12])
def test_bf16_expert_lora_of_any_rank_passes_the_cutlass_stride_checks(monkeypatch, rank):
    """bf16 on sm_90 (as grouped_kernel decides there): GEMMs whose weight has N and K multiples
    of 8 go to torch._grouped_mm (its meta kernel checks strides as CUDA does), the others to
    the Triton kernel (the op's fake on meta). Sending every GEMM to torch._grouped_mm fails for
    a rank that is not a multiple of 8: the check this routing avoids."""
    monkeypatch.setattr(transformer, "group_align", lambda x: 8)  # CUDA's padded groups
    sm90 = lambda x, w=None: "cutlass" if w is None or grouped_ops.cutlass_aligned(w) else "triton"  # noqa: E731
    monkeypatch.setattr(grouped_ops, "grouped_kernel", sm90)
    grads = _lora_experts_on_meta(rank)
    assert all(g is not None for g in grads)
    monkeypatch.setattr(grouped_ops, "grouped_kernel", lambda x, w=None: "cutlass")
    if rank % 8:
        with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
            _lora_experts_on_meta(rank)
    else:
        _lora_experts_on_meta(rank)
    assert grouped_ops.cutlass_aligned(torch.empty(8, 2 * 16, rank, dtype=torch.bfloat16)) == (rank % 8 == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [4, 8])
def test_bf16_expert_lora_on_a_gpu(rank):
    """The same on CUDA with values: a bf16 layer with an expert LoRA of rank 4 (Triton for the
    rank-r GEMMs on sm_90) or 8 (CUTLASS) against the fp32 layer on the CPU."""
    from moe_rl.model.lora import ExpertLora

    def layer(device, dtype):
        moe = make_moe(num_experts=8, top_k=2, hidden=64, inter=32).to(device=device, dtype=dtype)
        g = torch.Generator().manual_seed(5)
        lora = ExpertLora(scaling=2.0)
        shapes = [(8, rank, 64), (8, 64, rank), (8, rank, 32), (8, 64, rank)]
        ts = [(torch.randn(s, generator=g) * 0.2).to(device=device, dtype=dtype).requires_grad_() for s in shapes]
        lora.gate_up, lora.down = (ts[0], ts[1]), (ts[2], ts[3])
        moe.experts.lora = lora
        x = torch.randn(100, 64, generator=torch.Generator().manual_seed(6)).to(device=device, dtype=dtype)
        out, _ = moe(x)
        out.float().square().sum().backward()
        return [out] + [t.grad for t in ts]

    got, want = layer("cuda", torch.bfloat16), layer("cpu", torch.float32)
    for g_, w_ in zip(got, want):
        err = (g_.float().cpu() - w_).abs().max()
        assert err <= 2**-5 * w_.abs().max(), (float(err), float(w_.abs().max()))


class _NanGrad(torch.autograd.Function):
    """Identity whose gradient is NaN on the rows ``tail`` marks."""

    @staticmethod
    def forward(ctx, x, tail):
        ctx.save_for_backward(tail)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (tail,) = ctx.saved_tensors
        return torch.where(tail, float("nan"), g), None


def _nan_tail(real):
    """grouped_mm with what it leaves undefined made NaN: output rows after the last group, and
    the input gradient there (a GPU leaves whatever the memory held; a CPU's kernel too)."""
    def grouped_mm(x, w, offs):
        tail = ~grouped_ops.in_groups(x.shape[0], offs)
        if x.requires_grad:
            x = _NanGrad.apply(x, tail)
        return torch.where(tail, float("nan"), real(x, w, offs))
    return grouped_mm


@pytest.mark.parametrize("lora", [None, "per_expert", "shared_outer"])
def test_rows_after_the_last_group_are_neither_computed_nor_read(monkeypatch, lora):
    """CUDA's padded groups (align 8) leave a tail of up to E * 7 rows in no group: the last
    expert's group ends at its padded size, not at the buffer's end, and nothing the grouped
    GEMMs leave undefined there (NaN here) reaches the output or any gradient, with an expert
    LoRA (per-expert or shared outer factors) too: the same values as without padding."""
    from moe_rl.kernels.grouped_gemm import grouped_gemm_reference
    from moe_rl.model import ops as ops_mod
    from moe_rl.model.lora import ExpertLora

    def run():
        moe = make_moe(num_experts=8, top_k=3)
        extra = []
        if lora:
            g = torch.Generator().manual_seed(7)
            shared = lora == "shared_outer"
            shapes = [(1 if shared else 8, 4, 32), (8, 32, 4), (8, 4, 16), (1 if shared else 8, 32, 4)]
            extra = [(torch.randn(s, generator=g) * 0.3).requires_grad_() for s in shapes]
            moe.experts.lora = ExpertLora(scaling=2.0)
            moe.experts.lora.gate_up, moe.experts.lora.down = (extra[0], extra[1]), (extra[2], extra[3])
        x = torch.randn(37, 32, generator=torch.Generator().manual_seed(2))
        out, ids, grads = fwd_bwd(moe, x, grouped)
        return out, ids, list(grads.values()) + [t.grad for t in extra]

    want_out, want_ids, want_grads = run()
    monkeypatch.setattr(transformer, "group_align", lambda x: 8)
    monkeypatch.setattr(ops_mod, "grouped_mm", _nan_tail(grouped_ops.grouped_mm))  # the experts' and the LoRA's
    out, ids, grads = run()
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(want_grads) == 5 + (4 if lora else 0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    d = grouped_ops.dispatch(want_ids.reshape(-1), 8, 8)
    counts = torch.bincount(want_ids.reshape(-1), minlength=8)
    padded = (counts + 7) // 8 * 8
    assert torch.equal(d.offs.long(), padded.cumsum(0)) and d.rows == 37 * 3 + 8 * 7 > int(d.offs[-1])
    # the float64 fallback leaves the tail as zeros
    x64 = torch.randn(d.rows, 5, dtype=torch.float64)
    w64 = torch.randn(8, 6, 5, dtype=torch.float64)
    y = grouped_ops.padded_grouped_mm(x64, w64, d.offs)
    end = int(d.offs[-1])
    torch.testing.assert_close(y[:end], grouped_gemm_reference(x64, w64, d.offs)[:end])
    assert not y[end:].any()
