"""Worker of the EP=2 megatron LoRA test (spawned ranks import this module)."""
import torch

from tests.megatron.common import CPU_ARCH, make_mb, native_record


def check_lora_ep2(rank, world):
    import warnings

    warnings.filterwarnings("ignore")
    from tests.megatron.cpu_shims.sitecustomize import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()
    from moe_rl.config import ExperimentConfig
    from moe_rl.dist import build_groups
    from moe_rl.model import MoEForCausalLM, hf_state_dict, iter_local_hf_tensors
    from moe_rl.train.backend import NativeBackend
    from moe_rl.train.megatron import MegatronBackend

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"]
    cfg = ExperimentConfig.model_validate(dict(
        model=CPU_ARCH, pools=dict(trainer=world, rollout=0), engine=dict(kind="sglang", urls=["http://x"]),
        train=dict(backend="megatron", device="cpu", ep_size=world, megatron_dispatcher="allgather"),
        lora=dict(enabled=True, rank=4, alpha=8.0, targets=targets, sync="merged"),
    ))
    groups = build_groups(cfg)
    hf = hf_state_dict(MoEForCausalLM(cfg.model.arch()).init_weights(7, std=0.08))
    meg = MegatronBackend(cfg, groups, hf_state=hf)
    ncfg = cfg.model_copy(deep=True)
    ncfg.train.backend, ncfg.train.ep_size, ncfg.pools.trainer = "native", 1, 1
    native = NativeBackend(ncfg)  # the whole model in this process: the EP=1 reference
    with torch.no_grad():
        for name, t in iter_local_hf_tensors(native.model):
            t.copy_(hf[name])
    g = torch.Generator().manual_seed(11)
    full = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in native.lora.hf_tensors()}
    native.lora.load_hf_tensors(full)
    E_local = CPU_ARCH["num_experts"] // world
    lo = meg.ep_rank * E_local

    def mine(t):  # this EP rank's experts of a full expert adapter
        return t[lo : lo + E_local] if t.dim() == 3 else t

    meg.lora.load_hf_tensors({n: mine(t) for n, t in full.items()})
    mb = make_mb(CPU_ARCH["vocab_size"], (11, 20, 9))  # the same micro-batch on both ranks
    with native.lora.applied():
        mb.replay = native_record(native, mb)
    lp, _ = meg.logprobs(mb, 1.0)
    ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(3)
    adv = torch.where(torch.rand(mb.num_tokens, generator=gen) < 0.5, -1.0, 1.0)
    (-(adv * lp).sum()).backward()
    (-(adv * ref).sum()).backward()
    nat = dict(native.lora.named_parameters())
    for n, p in meg.lora.named_parameters():
        q = nat[n].grad
        # experts: this rank's slice; both ranks ran the same tokens, so its experts saw them twice
        want = 2 * mine(q) if q.dim() == 3 else q
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"rank {rank} {n}: {m}")
    import torch.distributed as dist

    dist.barrier()
