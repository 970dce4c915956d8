"""GPU placement of every rank, checked with made-up GPU counts (no GPU needed)."""
import pytest

from moe_rl.config import load_config
from moe_rl.placement import (
    PlacementError,
    check_before_launch,
    engine_weight_bytes,
    kv_bytes_per_request,
    kv_cache_slots,
    resolve_placement,
)


def cfg(*overrides, path="configs/tiny.yaml"):
    return load_config(path, list(overrides))


def test_cpu_has_no_gpus_and_gloo_sync():
    p = resolve_placement(cfg(), num_gpus=0)
    assert p.device == "cpu" and p.gpu(0) is None and p.sync_backend == "gloo"


def test_one_gpu_per_rank_while_there_are_enough():
    p = resolve_placement(cfg("train.device=cuda", "pools.trainer=2", "pools.rollout=2"), num_gpus=4)
    assert p.gpus == (0, 1, 2, 3) and p.sync_backend == "nccl" and not p.shares_gpu(2)


def test_one_gpu_colocates_trainer_and_engine_with_gloo_sync():
    """The issue's failure: 1 trainer + 1 engine rank on a 1-GPU machine (LOCAL_RANK=1 was used)."""
    p = resolve_placement(cfg("train.device=cuda", "sync.backend=gloo"), num_gpus=1)
    assert p.gpus == (0, 0) and p.shares_gpu(0) and p.shares_gpu(1)


def test_ipc_sync_is_for_one_machine_and_embedded_engines():
    from moe_rl.config import ConfigError

    assert resolve_placement(cfg("train.device=cuda", "sync.backend=ipc"), num_gpus=1).sync_backend == "ipc"
    with pytest.raises(PlacementError, match="sync.backend=ipc shares memory within one machine"):
        resolve_placement(cfg("train.device=cuda", "sync.backend=ipc", "pools.rollout=2", "pools.nproc_per_node=2",
                              "pools.nnodes=2"), num_gpus=2)
    with pytest.raises(ConfigError, match="sync.backend=ipc .* needs engine.kind=embedded"):
        cfg("sync.backend=ipc", "engine.kind=sglang", "engine.urls=[http://x:1]")


def test_fewer_gpus_than_ranks_trainers_first_then_engines_round_robin():
    p = resolve_placement(cfg("train.device=cuda", "pools.trainer=2", "pools.rollout=3", "sync.backend=gloo"),
                          num_gpus=3)
    assert p.gpus == (0, 1, 2, 0, 1)


def test_engines_sharing_a_gpu_must_fit_their_memory_fractions():
    c = cfg("train.device=cuda", "pools.rollout=3", "sync.backend=gloo", "placement.mem_fraction_static=0.4")
    with pytest.raises(PlacementError, match=r"placement.mem_fraction_static=0.4: 3 engine ranks share a GPU"):
        resolve_placement(c, num_gpus=1)
    assert resolve_placement(c, num_gpus=2).gpus == (0, 1, 0, 1)  # at most 2 engines on a GPU: 0.8


def test_colocated_with_nccl_sync_fails_naming_sync_backend():
    with pytest.raises(PlacementError, match=r"sync.backend=auto .*NCCL.*share GPU\(s\) \[0\].*sync.backend=gloo"):
        resolve_placement(cfg("train.device=cuda"), num_gpus=1)


def test_trainers_sharing_a_gpu_fail_naming_the_key():
    with pytest.raises(PlacementError, match=r"^pools.trainer: 2 trainer ranks on a node with 1 GPU"):
        resolve_placement(cfg("train.device=cuda", "pools.trainer=2", "sync.backend=gloo"), num_gpus=1)
    with pytest.raises(PlacementError, match=r"^placement.gpus: 2 trainer ranks"):
        resolve_placement(cfg("train.device=cuda", "pools.trainer=2", "sync.backend=gloo",
                              "placement.gpus=[1,1,0]"), num_gpus=2)


def test_explicit_map_is_used_and_checked_against_the_gpu_count():
    p = resolve_placement(cfg("train.device=cuda", "placement.gpus=[1,0]"), num_gpus=2)
    assert p.gpus == (1, 0)
    with pytest.raises(PlacementError, match=r"placement.gpus\[1\]=3: this node has 2 GPU"):
        resolve_placement(cfg("train.device=cuda", "placement.gpus=[0,3]"), num_gpus=2)


def test_no_gpu_and_nccl_on_cpu_are_refused():
    with pytest.raises(PlacementError, match="train.device=cuda but no CUDA device"):
        resolve_placement(cfg("train.device=cuda"), num_gpus=0)
    with pytest.raises(PlacementError, match="sync.backend=nccl needs train.device=cuda"):
        resolve_placement(cfg("sync.backend=nccl"), num_gpus=0)


def test_map_length_and_device_are_schema_errors():
    from moe_rl.config import ConfigError

    with pytest.raises(ConfigError, match="placement.gpus has 3 entries; it needs one per local rank"):
        cfg("train.device=cuda", "placement.gpus=[0,0,0]")
    with pytest.raises(ConfigError, match="placement.gpus is set but train.device is not cuda"):
        cfg("placement.gpus=[0,0]")


def test_multi_node_roles_per_node():
    """2 nodes x 2 ranks, 3 trainers: node 0 holds trainers 0,1; node 1 trainer 2 and engine 3."""
    c = cfg("train.device=cuda", "pools.trainer=3", "pools.rollout=1", "pools.nproc_per_node=2", "pools.nnodes=2",
            "sync.backend=gloo")
    with pytest.raises(PlacementError, match="pools.trainer: 2 trainer ranks on a node with 1 GPU"):
        resolve_placement(c, num_gpus=1)
    assert resolve_placement(c, num_gpus=2).gpus == (0, 1, 0, 1)


def test_kv_slots_from_memory_fraction_against_a_hand_count():
    c = cfg()
    arch = c.model.arch()
    per = kv_bytes_per_request(arch, 256, 4)
    assert per == 2 * 2 * 2 * 256 * 16 * 4  # K+V x layers x kv heads x context x head_dim x fp32
    weights = engine_weight_bytes(c)
    from moe_rl.engine.server import build_model

    n_params = sum(p.numel() for p in build_model(c).parameters())
    assert weights == n_params * 4
    gpu = 10 * 2**20
    slots = kv_cache_slots(arch, max_context=256, max_running_requests=10**6, element_size=4, weight_bytes=weights,
                           gpu_bytes=gpu, mem_fraction=0.5)
    assert slots == (gpu // 2 - weights) // per
    assert kv_cache_slots(arch, max_context=256, max_running_requests=3, element_size=4, weight_bytes=weights,
                          gpu_bytes=gpu, mem_fraction=0.5) == 3
    with pytest.raises(PlacementError, match=r"placement.mem_fraction_static=0.01: .* no room for one request"):
        kv_cache_slots(arch, max_context=256, max_running_requests=8, element_size=4, weight_bytes=weights,
                       gpu_bytes=gpu, mem_fraction=0.01)


def test_launcher_check_refuses_a_kv_cache_that_does_not_fit():
    c = cfg("train.device=cuda", "sync.backend=gloo", "placement.mem_fraction_static=0.001")
    with pytest.raises(PlacementError, match="placement.mem_fraction_static"):
        check_before_launch(c, num_gpus=1, gpu_bytes=80 * 2**30 // 1000)
    assert check_before_launch(c, num_gpus=1, gpu_bytes=80 * 2**30).gpus == (0, 0)


def test_shipped_gpu_1x_config_places_both_ranks_on_one_gpu():
    c = cfg(path="configs/gpu_1x.yaml")
    p = check_before_launch(c, num_gpus=1, gpu_bytes=80 * 2**30)
    assert p.gpus == (0, 0) and p.sync_backend == "ipc"
    arch = c.model.arch()
    weights = engine_weight_bytes(c)
    assert 1.5e9 < weights < 2e9  # ~0.43 B fp32 parameters: a model the GPU matters for
    slots = kv_cache_slots(arch, max_context=256, max_running_requests=c.engine.max_running_requests,
                           element_size=4, weight_bytes=weights, gpu_bytes=80 * 2**30, mem_fraction=0.25)
    assert slots == c.engine.max_running_requests  # an 80 GB GPU holds every request's KV cache
    default = resolve_placement(cfg("placement.gpus=null", path="configs/gpu_1x.yaml"), num_gpus=1)
    assert default.gpus == (0, 0)


def test_sync_backend_reaches_the_weight_sender():
    """sync.backend is what the trainer's sender forms the weight-sync group with (no group is
    formed here: that happens at the first push)."""
    from moe_rl.engine.server import build_model
    from moe_rl.sync.sender import WeightSender

    model = build_model(cfg())
    for value, want in (("auto", "gloo"), ("gloo", "gloo"), ("nccl", "nccl"), ("ipc", "ipc")):
        sender = WeightSender.from_config(model, cfg(f"sync.backend={value}", "sync.bind_params=false").sync)
        try:
            assert sender.backend == want
        finally:
            sender.close()


def test_moe_rl_train_refuses_before_starting_a_process(monkeypatch, capsys):
    """The issue's command on a made-up 1-GPU machine: refused naming sync.backend, before torchrun."""
    import types

    import torch
    import torch.distributed.run

    from moe_rl.cli import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.distributed.run, "main", lambda *a: pytest.fail("torchrun was started"))
    assert main(["train", "configs/tiny.yaml", "train.device=cuda"]) == 2
    assert "sync.backend=auto uses NCCL" in capsys.readouterr().err
    assert main(["train", "configs/gpu_1x.yaml", "placement.gpus=[0,1]"]) == 2
    assert "placement.gpus[1]=1: this node has 1 GPU" in capsys.readouterr().err
