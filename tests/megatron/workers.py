"""Worker functions of the CPU megatron tests (spawned ranks import this module, not the
test module, so that a rank without a trainer role never imports megatron-core)."""
import torch
import torch.distributed as dist

from moe_rl.config import ExperimentConfig

MODEL = dict(vocab_size=48, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
             mlp_only_layers=[1], rope_theta=10000.0)


def _cfg(trainers=1, ep=1, rollout=0, **train):
    return ExperimentConfig.model_validate(dict(
        model=MODEL, pools=dict(trainer=trainers, rollout=rollout), engine=dict(kind="sglang", urls=["http://x"])
        if rollout == 0 else dict(kind="embedded"),
        train=dict(backend="megatron", ep_size=ep, megatron_dispatcher="allgather", **train),
    ))


def check_backend(rank, world, trainers, ep):
    import warnings

    warnings.filterwarnings("ignore")
    from moe_rl.dist import build_groups

    cfg = _cfg(trainers, ep, rollout=world - trainers)
    groups = build_groups(cfg)
    if rank < trainers:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from moe_rl.model import MoEForCausalLM, hf_param_specs, hf_state_dict
        from moe_rl.train.megatron import MegatronBackend
        from moe_rl.train.megatron.convert import megatron_expert_owner, megatron_param_specs

        backend = MegatronBackend(cfg, groups)
        assert backend.ep_rank == rank % ep
        # names and shapes: what GPTModel built == what the converter says
        built = {n: tuple(p.shape) for n, p in backend.model.named_parameters()}
        assert built == dict(megatron_param_specs(backend.arch, backend.layout))
        assert len(RouterReplay.global_router_replay_instances) == len(backend.arch.moe_layers)
        # weights: HF (native seeded init) -> GPTModel -> hf_tensors, bit for bit, this rank's share
        ref = hf_state_dict(MoEForCausalLM(backend.arch).init_weights(cfg.model.init_seed))
        got = list(backend.hf_tensors())
        expected = [n for n, _ in hf_param_specs(backend.arch) if megatron_expert_owner(n, backend.arch, ep) in (None, backend.ep_rank)]
        assert [n for n, _ in got] == expected
        for name, t in got:
            assert torch.equal(t, ref[name]), name
        # megatron's EP group is this trainer's block of the pool (moe_rl.dist's layout)
        from megatron.core import parallel_state as ps

        assert dist.get_process_group_ranks(ps.get_expert_model_parallel_group()) == groups.layout.ep_groups[rank // ep]
    dist.barrier()
