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
        train=dict(backend="megatron", ep_size=ep, **{"megatron_dispatcher": "allgather", **train}),
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
        if ep == 2:
            check_unequal_micro_batches(backend, groups, rank, trainers)
    dist.barrier()



def _native_reference(backend):
    """The EP=1 reference: the whole model on the native backend in this process, with the
    megatron backend's initial weights (its config's seeded init)."""
    from moe_rl.model import MoEForCausalLM, hf_state_dict, iter_local_hf_tensors
    from moe_rl.train.backend import NativeBackend

    ncfg = backend.cfg.model_copy(deep=True)
    ncfg.train.backend, ncfg.train.ep_size, ncfg.pools.trainer, ncfg.pools.rollout = "native", 1, 1, 0
    ncfg.engine.kind, ncfg.engine.urls = "sglang", ["http://x"]
    native = NativeBackend(ncfg)
    hf = hf_state_dict(MoEForCausalLM(backend.arch).init_weights(backend.cfg.model.init_seed))
    with torch.no_grad():
        for name, t in iter_local_hf_tensors(native.model):
            t.copy_(hf[name])
    return native


def check_unequal_micro_batches(backend, groups, rank, world):
    """The two EP ranks' shards of a minibatch pack into micro-batches of different lengths (and
    one rank's last micro-batch is a dummy): the loop pads them to equal lengths, so megatron's
    allgather dispatcher runs forward and backward, and the real rows' log-probs are the EP=1
    native model's on the unpadded micro-batches."""
    from tests.megatron.cpu_shims.sitecustomize import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()  # megatron's forward on CPU (this spawned rank only)
    from moe_rl.train.loop import make_micro_batches, shard_micro_batches

    assert backend.equal_tokens_per_ep_rank
    native = _native_reference(backend)
    assert not native.equal_tokens_per_ep_rank
    g = torch.Generator().manual_seed(5)

    def sample(p, r):
        return dict(prompt_ids=torch.randint(1, MODEL["vocab_size"], (p,), generator=g).tolist(),
                    response_ids=torch.randint(1, MODEL["vocab_size"], (r,), generator=g).tolist(),
                    behaviour_logprobs=[-1.0] * r, advantage=1.0)

    # micro_batch_size 2: rank 0 packs samples (0, 2) = 27 tokens, then (4,) = 5; rank 1 (1, 3) =
    # 13, then a dummy (2)
    part = [sample(5, 7), sample(3, 2), sample(6, 9), sample(4, 4), sample(2, 3)]
    micro = shard_micro_batches(part, rank, world, 2, backend.arch, None, groups.layout.ep_groups[0])
    plain = make_micro_batches(part[rank::world], 2, len(micro), backend.arch, None)
    assert [mc.mb.num_tokens for mc in micro] == [27, 5]  # the longer rank's lengths, on both ranks
    for mc, ref_mc in zip(micro, plain):
        lp, _ = backend.logprobs(mc.mb, 1.0)
        lp.sum().backward()
        if not mc.chunk:
            continue
        T = ref_mc.mb.num_tokens
        assert torch.equal(mc.mb.labels[T:], torch.full_like(mc.mb.labels[T:], -100))  # the padding has no label
        assert torch.equal(mc.resp_pos, ref_mc.resp_pos)
        ref, _ = native.logprobs(ref_mc.mb, 1.0)
        torch.testing.assert_close(lp[:T], ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {rank}: {m}")


def check_alltoall_ep2(rank, world):
    """megatron's alltoall token dispatcher (the default on GPUs) at EP=2 on CPU, under the
    stream stand-ins of ``cpu_shim_patches``: the two ranks' micro-batches differ in length and
    are not padded (the dispatcher exchanges the token counts); each rank's log-probs equal the
    EP=1 native model's, and so does every gradient (the dense ones summed over the ranks, each
    rank's experts' from both ranks' tokens)."""
    import warnings

    warnings.filterwarnings("ignore")
    from tests.megatron.common import make_mb, native_grads_by_hf_name
    from tests.megatron.cpu_shims.sitecustomize import apply_megatron_cpu_shims

    apply_megatron_cpu_shims()  # before the build: the dispatcher makes its side stream there
    from moe_rl.dist import build_groups
    from moe_rl.train.megatron import MegatronBackend
    from moe_rl.train.megatron.convert import megatron_to_hf

    cfg = _cfg(world, 2, megatron_dispatcher="alltoall")
    backend = MegatronBackend(cfg, build_groups(cfg))
    assert backend.opts.dispatcher == "alltoall" and not backend.equal_tokens_per_ep_rank
    native = _native_reference(backend)
    mbs = [make_mb(MODEL["vocab_size"], (5, 9), seed=0), make_mb(MODEL["vocab_size"], (13, 4, 7), seed=1)]
    advs = [torch.linspace(-1, 1, mb.num_tokens) for mb in mbs]
    lp, _ = backend.logprobs(mbs[rank], 1.0)
    for r, (mb, adv) in enumerate(zip(mbs, advs)):
        ref, _ = native.logprobs(mb, 1.0)
        if r == rank:
            torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {rank}: {m}")
        (adv * ref).sum().backward()
    (advs[rank] * lp).sum().backward()
    backend._reduce_grads()
    tensors = backend._tensors()
    got = dict(megatron_to_hf(lambda n: tensors[n].grad, backend.arch, backend.layout))
    want = native_grads_by_hf_name(native)
    assert len(got) < len(want) and any(".experts." in n for n in got)  # this rank's experts only
    for name, g in got.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"rank {rank} {name}: {m}")
    dist.barrier()
