"""Helpers shared by the megatron forward tests (CPU with shims, and GPU)."""
import contextlib

import torch

from moe_rl.config import ExperimentConfig
from moe_rl.model import MoEForCausalLM, hf_state_dict, iter_local_hf_tensors
from moe_rl.train.backend import MicroBatch, NativeBackend

GPU_ARCH = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
                mlp_only_layers=[1], rope_theta=1_000_000.0, max_position_embeddings=1024)
CPU_ARCH = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=[1], rope_theta=10_000.0, max_position_embeddings=256)


def make_cfg(arch, device, dtype="float32", **train):
    train.setdefault("megatron_dispatcher", "alltoall" if device == "cuda" else "allgather")
    return ExperimentConfig.model_validate(dict(
        model=dict(arch, dtype=dtype), pools=dict(trainer=1, rollout=0),
        engine=dict(kind="sglang", urls=["http://127.0.0.1:1"]),
        train=dict(backend="megatron", device=device, lr=3e-3, grad_clip=1.0, **train),
    ))


def build(arch, device, dtype="float32", seed=7, std=0.08, lora=None, **train):
    """(megatron backend, native backend) holding identical weights (``lora``: a LoraConfig
    for both)."""
    from moe_rl.train.megatron import MegatronBackend

    cfg = make_cfg(arch, device, dtype, **train)
    if lora is not None:
        cfg = cfg.model_copy(update={"lora": lora})
    hf = hf_state_dict(MoEForCausalLM(cfg.model.arch()).init_weights(seed, std=std))
    meg = MegatronBackend(cfg, None, hf_state=hf)
    native_cfg = cfg.model_copy(deep=True)
    native_cfg.train.backend = "native"
    native = NativeBackend(native_cfg)
    with torch.no_grad():
        for name, t in iter_local_hf_tensors(native.model):
            t.copy_(hf[name])
    return meg, native


def make_mb(vocab, lengths, seed=0, replay=None):
    """One packed row of sequences; labels are the next token inside each sequence."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(0, vocab, (1, T), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    labels = torch.full((T,), -100)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        labels[a : b - 1] = ids[0, a + 1 : b]
    return MicroBatch(ids, cu, labels, replay)


def native_record(native, mb):
    """The experts the native model picks per MoE layer (what an engine would record)."""
    rec = []
    with torch.no_grad():
        native.model.hidden_states(mb.input_ids.to(native.device), cu_seqlens=mb.cu_seqlens.to(native.device), record=rec)
    return [r.cpu() for r in rec]


def native_hidden(native, mb):
    replay = None if mb.replay is None else [r.to(native.device) for r in mb.replay]
    return native.model.hidden_states(mb.input_ids.to(native.device), cu_seqlens=mb.cu_seqlens.to(native.device),
                                      replay=replay)[0]


def native_grads_by_hf_name(native) -> dict:
    """The native model's gradients under HF names (each parameter pointed at its grad while
    the HF view is read, then restored)."""
    with torch.no_grad():
        saved = [(p, p.data) for p in native.model.parameters()]
        for p, _ in saved:
            p.data = p.grad
        try:
            return {n: t.clone() for n, t in iter_local_hf_tensors(native.model)}
        finally:
            for p, data in saved:
                p.data = data


def random_correction_bias(meg, native, num_experts, seed=5):
    """The same random expert-score correction bias in both models' sigmoid routers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in meg.arch.moe_layers:
            bias = torch.randn(num_experts, generator=g) * 0.1
            native.model.model.layers[layer].mlp.gate.e_score_correction_bias.copy_(bias)
            meg.model.decoder.layers[layer].mlp.router.expert_bias.copy_(bias)


def equal_logprobs_then_backward(meg, native, mb):
    """Megatron's log-probs of ``mb`` equal the native model's; then one policy-gradient-shaped
    loss (per-token advantages from -1 to 1) goes backward through both."""
    adv = torch.linspace(-1, 1, mb.num_tokens)
    lp, _ = meg.logprobs(mb, 1.0)
    lp_ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    (adv * lp).sum().backward()
    (adv * lp_ref).sum().backward()


def assert_logprobs_and_grads_equal_native(meg, native, mb):
    """Megatron's log-probs of ``mb`` equal the native model's, and so does every parameter's
    gradient of one policy-gradient-shaped loss, mapped to HF names (each non-zero; the
    correction bias is a buffer in both, with none)."""
    from moe_rl.train.megatron.convert import megatron_to_hf

    equal_logprobs_then_backward(meg, native, mb)
    tensors = meg._tensors()
    got = dict(megatron_to_hf(lambda n: tensors[n].grad if tensors[n].requires_grad else torch.zeros_like(tensors[n]),
                              meg.arch, meg.layout))
    # gradients map through the conversion's linear part: less the image of zero (the hybrid
    # families' DeltaNet norm converts as w = w' + 1)
    offset = dict(megatron_to_hf(lambda n: torch.zeros_like(tensors[n]), meg.arch, meg.layout))
    got = {n: g - offset[n] for n, g in got.items()}
    want = native_grads_by_hf_name(native)
    assert got.keys() == want.keys()
    for name, g in want.items():
        if name.endswith("e_score_correction_bias"):
            continue
        assert g.abs().sum() > 0, name
        # a DeltaNet's gradients come through megatron's fp32 chunked scan and ours: their
        # rounding differs by up to ~1.6e-5 (depending on the CPU's kernels)
        atol = 3e-5 if ".linear_attn." in name else 1e-5
        torch.testing.assert_close(got[name], g, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def assert_lora_logprobs_and_adapter_grads_equal_native(meg, native, mb, nonzero=False):
    """Megatron's log-probs of ``mb`` with LoRA equal the native model's, and so does every
    adapter's gradient of one policy-gradient-shaped loss (``nonzero``: each also non-zero, for
    adapters loaded with non-zero B)."""
    equal_logprobs_then_backward(meg, native, mb)
    nat = dict(native.lora.named_parameters())
    for n, p in meg.lora.named_parameters():
        if nonzero:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, nat[n].grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    return nat


def random_routes(T, num_experts, top_k, layers, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(T, num_experts, generator=g).argsort(1)[:, :top_k] for _ in range(layers)]


@contextlib.contextmanager
def router_calls(meg):
    """Yields a list receiving (moe layer index, routing_map [tokens, experts]) per router call."""
    calls, handles = [], []
    routers = [layer.mlp.router for layer in meg.model.decoder.layers if hasattr(layer.mlp, "router")]
    for i, router in enumerate(routers):
        handles.append(router.register_forward_hook(
            lambda mod, inp, out, i=i: calls.append((i, out[1].detach().cpu().clone()))))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def routing_mask(ids, num_experts):
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool).scatter(1, ids, True)


def pg_step(backend, mbs, advantages, n_tokens):
    """One RL step with a policy-gradient surrogate: micro-batch backward passes in forward order."""
    total = 0.0
    for mb, adv in zip(mbs, advantages):
        lp, _ = backend.logprobs(mb, 1.0)
        loss = -(adv.to(lp.device) * lp).sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    backend.optimizer_step()
    return total


def replayed_batch(native, vocab, lengths):
    """Two micro-batches replaying the native model's routing, per-token advantages of +-1 and
    the token count: the fixed batch of the RL-step tests."""
    mbs = [make_mb(vocab, lengths, seed=s) for s in (0, 1)]
    for mb in mbs:
        mb.replay = native_record(native, mb)
    g = torch.Generator().manual_seed(3)
    adv = [torch.where(torch.rand(mb.num_tokens, generator=g) < 0.5, -1.0, 1.0) for mb in mbs]
    n_tokens = sum(int((mb.labels != -100).sum()) for mb in mbs)
    return mbs, adv, n_tokens
