"""LoRA on megatron-core's GPTModel (CPU, fp32, shims of test_forward_cpu) against the native
trainer's LoRA: same base weights and same adapter weights give the same log-probs and the same
adapter gradients; only the adapters train; weight sync and PEFT files use the native names."""
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from moe_rl.config import LoraConfig
from moe_rl.model import MoEForCausalLM, iter_local_hf_tensors

from .common import CPU_ARCH, build, make_cfg, make_mb, native_record
from .test_forward_cpu import LENGTHS, cpu_megatron  # noqa: F401  (fixture)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"]


def build_lora(sync="adapter", targets=TARGETS, layers=None, seed=7, arch=CPU_ARCH, device="cpu", dtype="float32",
               shared=False):
    """(megatron, native) backends with LoRA: identical base weights and identical random
    adapters (B != 0, so every adapter changes the function)."""
    meg, native = build(arch, device, dtype, seed=seed, lora=LoraConfig(
        enabled=True, rank=4, alpha=8.0, targets=targets, layers=layers, sync=sync, experts_shared_outer=shared))
    g = torch.Generator().manual_seed(11)
    ad = {n: (torch.randn(t.shape, generator=g) * 0.2).to(t) for n, t in native.lora.hf_tensors()}
    native.lora.load_hf_tensors(ad)
    meg.lora.load_hf_tensors(ad)  # the same names: fails if the megatron adapters are laid out otherwise
    return meg, native


def _adv(mb, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(mb.num_tokens, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("shared", [False, True])
def test_lora_logprobs_and_adapter_grads_equal_native(cpu_megatron, shared):
    meg, native = build_lora(shared=shared)
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    rec_native = native_record(native, mb)  # the adapted router's choice (the backend's adapters are attached)
    rec_meg = []
    with torch.no_grad():
        lp0, _ = meg.logprobs(mb, 1.0, record=rec_meg)  # megatron's adapted router chooses
        ref0, _ = native.logprobs(mb, 1.0)
    for a, b in zip(rec_meg, rec_native):
        assert torch.equal(a, b)
    torch.testing.assert_close(lp0, ref0, atol=1e-5, rtol=1e-5)
    # the adapters matter: without them the log-probs differ clearly
    meg._megatron_lora, saved = None, meg._megatron_lora
    with torch.no_grad():
        lp_base, _ = meg.logprobs(mb, 1.0)
    meg._megatron_lora = saved
    assert (lp_base - lp0).abs().max() > 1e-2

    mb.replay = rec_native
    adv = _adv(mb)
    lp, _ = meg.logprobs(mb, 1.0)
    ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    (-(adv * lp).sum()).backward()
    (-(adv * ref).sum()).backward()
    meg_named, nat_named = dict(meg.lora.named_parameters()), dict(native.lora.named_parameters())
    assert meg_named.keys() == nat_named.keys()
    for n, p in meg_named.items():
        q = nat_named[n]
        assert p.grad is not None and q.grad is not None, n
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos >= 0.999, (n, float(cos))
        # native computes the adapters in the forward, megatron as weight deltas: the same
        # function, summed in another order (fp32 rounding over all tokens)
        torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    # the base weights got no gradient (frozen)
    assert all(p.grad is None and not p.requires_grad for p in meg.model.parameters())


def test_lora_step_changes_only_adapters_and_sync_names(cpu_megatron, tmp_path):
    from moe_rl.model.lora import AdapterSource, LoraAdapters, load_peft, save_peft

    meg, native = build_lora(sync="adapter", targets=["q_proj", "v_proj", "router", "experts.gate_up_proj"],
                             layers=[0, 2])
    base = {n: p.detach().clone() for n, p in meg.model.named_parameters()}
    adapters = {n: p.detach().clone() for n, p in meg.lora.named_parameters()}
    opt_ids = {id(p) for g in meg.optimizer.param_groups for p in g["params"]}
    assert opt_ids == {id(p) for p in meg.lora.parameters()}
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    adv = _adv(mb)
    for b in (meg, native):
        lp, _ = b.logprobs(mb, 1.0)
        (-(adv * lp).sum() / mb.num_tokens).backward()
        b.optimizer_step()
    for n, p in meg.model.named_parameters():
        assert torch.equal(p, base[n]), n
    changed = [n for n, p in meg.lora.named_parameters() if not torch.equal(p, adapters[n])]
    assert len(changed) == len(adapters)
    # after the same step both backends hold the same adapters, so the same merged weights
    nat = dict(native.lora.named_parameters())
    for n, p in meg.lora.named_parameters():
        torch.testing.assert_close(p, nat[n], atol=1e-5, rtol=1e-4)
    merged_native = dict(native.hf_tensors())
    merged_meg = list(meg.hf_tensors())
    assert [n for n, _ in merged_meg] == list(merged_native)
    for n, t in merged_meg:
        torch.testing.assert_close(t, merged_native[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    assert not torch.equal(merged_native["model.layers.0.self_attn.v_proj.weight"],
                           dict(iter_local_hf_tensors(native.model))["model.layers.0.self_attn.v_proj.weight"])
    # lora.sync=adapter: the native AdapterSource, the native names and shapes
    src, ref = meg.hf_source(), AdapterSource(native.lora)
    assert isinstance(src, AdapterSource) and src.specs() == ref.specs()
    # PEFT file via the native writer, read back by the native loader
    save_peft(meg.lora, tmp_path / "adapter")
    fresh = LoraAdapters(MoEForCausalLM(meg.arch), 4, 8.0, meg.cfg.lora.targets, meg.cfg.lora.layers)
    load_peft(fresh, tmp_path / "adapter")
    for (n, a), (_, b) in zip(fresh.hf_tensors(), meg.lora.hf_tensors()):
        assert torch.equal(a, b), n
    # trainer state round trip carries the adapters
    other, _ = build_lora(sync="adapter", targets=["q_proj", "v_proj", "router", "experts.gate_up_proj"],
                          layers=[0, 2], seed=99)
    other.load_state_dict(meg.state_dict())
    for (n, a), (_, b) in zip(other.lora.hf_tensors(), meg.lora.hf_tensors()):
        assert torch.equal(a, b), n


def test_lora_megatron_config_refusals():
    d = make_cfg(CPU_ARCH, "cpu").model_dump()
    d["lora"] = {"enabled": True}
    for key, match in [("megatron_recompute", "megatron_recompute"), ("tp_size", "tp_size=1")]:
        bad = {**d, "train": {**d["train"], key: True if key == "megatron_recompute" else 2}}
        with pytest.raises(ValueError, match=match):
            type(make_cfg(CPU_ARCH, "cpu")).model_validate(bad)
    type(make_cfg(CPU_ARCH, "cpu")).model_validate(d)  # megatron + LoRA is accepted


def test_lora_ep2_equals_native():
    """EP=2 over gloo (allgather dispatcher): each rank's adapters are its slice of the native
    adapters, and its log-probs and adapter gradients are the EP=1 native model's."""
    from tests.distributed import run_distributed

    from .lora_workers import check_lora_ep2

    run_distributed(check_lora_ep2, 2, timeout=240)
