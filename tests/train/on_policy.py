"""A real training step against the embedded engine, in this process (``moe_rl.bench.on_policy``'s
harness: the engine samples a batch, its routing recorded into a replay log, the trainer trains on
it with R3 replay, its weights go back to the engine), plus the trainer's log-probs of a batch as
its step's first forward takes them, to put beside the engine's; the test configs."""
from __future__ import annotations

import torch

from moe_rl.bench.on_policy import make_trainer, rollout, sync
from moe_rl.config import load_config
from moe_rl.dist import Groups, Layout
from moe_rl.engine.server import build_engine
from moe_rl.train.loop import Trainer, replay_rows

# a small model: 3 layers, the middle one dense (dense rows in the record), 8 experts, top-2
SMALL = ["model.vocab_size=48", "model.hidden_size=32", "model.intermediate_size=48", "model.moe_intermediate_size=16",
         "model.num_hidden_layers=3", "model.num_attention_heads=4", "model.num_key_value_heads=2",
         "model.head_dim=8", "model.num_experts=8", "model.num_experts_per_tok=2",
         "model.max_position_embeddings=128", "model.init_std=0.3", "engine.max_context=128",
         "engine.max_running_requests=32", "rollout.prompts_per_step=6", "rollout.group_size=2",
         "rollout.max_new_tokens=10", "rollout.temperature=1.0", "train.micro_batch_size=6", "train.lr=0.05"]
QWEN = ["model.mlp_only_layers=[1]"]
GLM = ["model.model_type=glm4_moe", "model.n_shared_experts=1", "model.first_k_dense_replace=1", "model.n_group=2",
       "model.topk_group=1", "model.routed_scaling_factor=2.0"]
DSV3 = [*GLM[:-1], "model.model_type=deepseek_v3", "model.routed_scaling_factor=2.0", "model.q_lora_rank=12",
        "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6"]
DSV3 = [o for o in DSV3 if o != "model.model_type=glm4_moe"]
LORA = ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.sync=adapter",
        "lora.targets=[q_proj,o_proj,router,experts.gate_up_proj,experts.down_proj]"]


def config(*overrides, exact: bool = True):
    return load_config(None, [*SMALL, *overrides, f"true_on_policy={str(exact).lower()}", "engine.threads=1"])


def trainer(cfg, replay_dir, rank: int = 0, groups: Groups | None = None) -> Trainer:
    """A trainer without engines (no ``setup``), reading routing from ``replay_dir``."""
    if groups is None:
        layout = Layout(world_size=1, trainer_ranks=[0], rollout_ranks=[], ep_size=1)
        groups = Groups(layout=layout, rank=rank, role="trainer")
    return make_trainer(cfg, replay_dir, groups)


def trainer_logprobs(t: Trainer, batch: list[dict]) -> torch.Tensor:
    """The trainer's log-probs of every response token of ``batch`` (its shard on this rank),
    as the step's first forward takes them: packed micro-batches, the engine's routing replayed."""
    t.reader.refresh()
    prep = t._prepare(batch)
    out = []
    with torch.no_grad():
        for mc in prep["micro"]:
            d = t._on_device(mc)
            assert d.mb.replay is not None or not d.chunk  # R3: the engine's experts
            lp = t.backend.logprobs(d.mb, t.cfg.rollout.temperature)[0]
            if d.chunk:
                out.append(lp[d.resp_pos])
    return torch.cat(out)


def behaviour(batch: list[dict], rank: int = 0, world: int = 1) -> torch.Tensor:
    return torch.tensor([x for s in batch[rank::world] for x in s["behaviour_logprobs"]], dtype=torch.float32)


def engine_for(cfg):
    return build_engine(cfg).start()


__all__ = ["config", "trainer", "rollout", "trainer_logprobs", "behaviour", "sync", "engine_for", "replay_rows",
           "QWEN", "GLM", "DSV3", "LORA"]
