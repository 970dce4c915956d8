"""fp32 main parameters: a bf16 model stepped through MainParamsOptimizer follows an fp32 AdamW
run fed the same gradients, and keeps updates that plain bf16 AdamW rounds away."""
import torch

from moe_rl.train.main_params import MainParamsOptimizer

KW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def test_follows_fp32_adamw_on_the_same_grads():
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(16, 8, generator=g), torch.randn(8, generator=g)]
    model = [t.bfloat16().requires_grad_() for t in init]
    ref = [t.bfloat16().float().requires_grad_() for t in init]  # fp32, same starting values
    opt, ref_opt = MainParamsOptimizer(model, **KW), torch.optim.AdamW(ref, **KW)
    for _ in range(20):
        grads = [torch.randn(t.shape, generator=g) for t in init]
        for p, r, gr in zip(model, ref, grads):
            p.grad = gr.bfloat16()
            r.grad = gr.bfloat16().float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, main, r in zip(model, opt.main_params, ref):
        assert p.dtype == torch.bfloat16 and main.dtype == torch.float32
        torch.testing.assert_close(main, r, atol=0, rtol=0)
        assert torch.equal(p, r.detach().bfloat16())
        assert p.grad is None


def test_small_updates_accumulate_where_bf16_adamw_loses_them():
    w = torch.full((4,), 1.0)
    model, plain = w.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    opt = MainParamsOptimizer([model], lr=1e-4, weight_decay=0.0)
    plain_opt = torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0)
    for _ in range(50):  # each step moves w by ~1e-4, below bf16's spacing at 1.0 (2^-7)
        model.grad = torch.ones(4, dtype=torch.bfloat16)
        plain.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
        plain_opt.step()
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))  # bf16 AdamW: no movement at all
    assert (opt.main_params[0] < 1 - 4e-3).all() and (model < 1).all()


def test_state_dict_round_trip():
    p = torch.randn(5).bfloat16().requires_grad_()
    opt = MainParamsOptimizer([p], **KW)
    p.grad = torch.randn(5).bfloat16()
    opt.step()
    state = opt.state_dict()
    q = torch.zeros(5).bfloat16().requires_grad_()
    opt2 = MainParamsOptimizer([q], **KW)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.main_params[0], opt.main_params[0]) and torch.equal(q, p.detach())


def test_a_plain_adamw_state_of_the_same_params_loads():
    """A checkpoint of a bf16 run stepped by plain AdamW: its moments come in as fp32, the main
    params start from the model's weights, and the next step matches plain AdamW's in fp32."""
    p = torch.randn(5).bfloat16().requires_grad_()
    plain = torch.optim.AdamW([p], **KW)
    p.grad = torch.randn(5).bfloat16()
    plain.step()
    q = p.detach().clone().requires_grad_()
    opt = MainParamsOptimizer([q], **KW)
    opt.load_state_dict(plain.state_dict())
    moments = opt.optimizer.state[opt.main_params[0]]
    assert moments["exp_avg"].dtype == torch.float32
    assert torch.equal(moments["exp_avg"], plain.state[p]["exp_avg"].float())
    assert torch.equal(opt.main_params[0], p.detach().float())


def _backend(dtype: str, *overrides: str):
    from moe_rl.config import load_config
    from moe_rl.train.backend import NativeBackend

    cfg = load_config(None, ["model.vocab_size=32", "model.hidden_size=32", "model.moe_intermediate_size=16",
                             "model.num_hidden_layers=2", "model.num_experts=4", "model.num_experts_per_tok=2",
                             f"model.dtype={dtype}", "train.device=cpu", "train.compile=false", "train.grad_clip=1e-3",
                             *overrides])
    return NativeBackend(cfg)


def _one_step(backend, monkeypatch):
    """One backward of a sum over the logits, then the backend's step (clipped: the norm is far
    above 1e-3); returns the dtypes of the scales the clip multiplied the grads by."""
    backend.model(torch.tensor([[1, 2, 3, 4, 5]])).float().square().mean().backward()
    scales, mul = [], torch._foreach_mul_

    def recording(tensors, scale):
        scales.append((tensors[0].dtype, scale.dtype))
        return mul(tensors, scale)

    monkeypatch.setattr(torch, "_foreach_mul_", recording)
    stats = backend.optimizer_step()
    monkeypatch.undo()
    assert float(stats["grad_norm"]) > 1e-3
    return scales


def test_a_bf16_native_backend_steps_fp32_main_params(monkeypatch):
    """The native backend in bf16 keeps fp32 main parameters and Adam state (as the megatron
    backend and megatron's own optimizer do): every weight's fp32 copy moves on the first step,
    most by less than bf16 can show. The clip scales each dtype's grads by a scale of their own
    dtype (another sends CUDA's multi-tensor kernel one tensor at a time)."""
    backend = _backend("bfloat16")
    assert isinstance(backend.optimizer, MainParamsOptimizer)
    before = [m.detach().clone() for m in backend.optimizer.main_params]
    scales = _one_step(backend, monkeypatch)
    assert scales == [(torch.bfloat16, torch.bfloat16)]
    moved = [bool((m != b).any()) for m, b in zip(backend.optimizer.main_params, before)]
    assert all(moved), f"{moved.count(False)} of {len(moved)} fp32 main parameters did not move"
    for p, m in zip(backend.optimizer.model_params, backend.optimizer.main_params):
        assert torch.equal(p, m.detach().bfloat16())


def test_an_fp32_native_backend_steps_its_weights_with_adamw(monkeypatch):
    backend = _backend("float32")
    assert type(backend.optimizer) is torch.optim.AdamW
    assert _one_step(backend, monkeypatch) == [(torch.float32, torch.float32)]


def test_a_fused_adamw_keeps_the_trainers_parameters_dense_in_the_sync_buckets(monkeypatch):
    """CUDA's fused AdamW takes only parameters that are non-overlapping and dense, with grads of
    the same strides. The weight sync's buckets hold HF tensors in HF order (each expert's gate,
    up and down back to back), so an expert stack bound there is strided: a trainer whose AdamW
    is fused keeps its own storage (the sync packs), one whose AdamW is not binds as before."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    import moe_rl.train.backend as backend_mod
    from moe_rl.sync.sender import WeightSender

    def layout_ok(model):
        return all(dense(p) and (p.grad is None or p.grad.stride() == p.stride()) for p in model.parameters())

    plain = _backend("float32")
    assert not plain.needs_dense_params
    WeightSender(plain.model, engines=[], bucket_mb=1, bind_params=True, dense_params=plain.needs_dense_params)
    assert not layout_ok(plain.model)  # bound: the expert stacks step over three HF tensors

    monkeypatch.setattr(backend_mod, "fused_adamw", lambda params: True)  # CUDA's choice, on a CPU
    fused = _backend("float32")
    assert fused.needs_dense_params and fused.optimizer.param_groups[0]["fused"]
    sender = WeightSender(fused.model, engines=[], bucket_mb=1, bind_params=True,
                          dense_params=fused.needs_dense_params)
    assert sender._bound is None
    fused.model(torch.tensor([[1, 2, 3, 4, 5]])).float().square().mean().backward()
    assert layout_ok(fused.model)
    fused.optimizer_step()


def test_the_optimizer_takes_every_adamw_setting_from_the_config():
    """train.lr, betas, adam_eps and weight_decay reach the step: one step of the backend moves
    the weights as torch's AdamW with those settings does from the same gradients. A large
    epsilon makes a visible difference (the first step's update is about lr * g / (|g| + eps))."""
    settings = dict(lr=0.05, betas=(0.5, 0.9), eps=0.3, weight_decay=0.2)
    backend = _backend("float32", "train.grad_clip=null", "train.lr=0.05", "train.betas=[0.5,0.9]",
                       "train.adam_eps=0.3", "train.weight_decay=0.2")
    params = backend.dense_params + backend.expert_params
    backend.model(torch.tensor([[1, 2, 3, 4, 5]])).float().square().mean().backward()

    def reference(**kw):
        copies = [p.detach().clone().requires_grad_() for p in params]
        for c, p in zip(copies, params):
            c.grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        torch.optim.AdamW(copies, **kw).step()
        return [c.detach() for c in copies]

    expected, default_eps = reference(**settings), reference(**{**settings, "eps": 1e-8})
    backend.optimizer_step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)
    assert max((p.detach() - d).abs().max().item() for p, d in zip(params, default_eps)) > 1e-3
