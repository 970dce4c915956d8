"""One validated schema for a whole experiment, loaded from YAML with ``key.sub=value`` overrides.

Unknown keys are errors (with the closest valid key suggested); every error names the key path.
"""
from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .model.arch import MoEArch

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and key path."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(MoEArch):
    """Architecture (HF field names; ``model_type`` picks the family) plus where the weights come from."""

    path: str | None = Field(None, description="HF checkpoint directory (config.json + safetensors) to start "
                             "from; its config.json replaces every architecture key above. null = a seeded random "
                             "init of the architecture above (model.init_seed, model.init_std)")
    tokenizer_path: str | None = Field(None, description="HF tokenizer directory (tokenizer files, chat template, "
                                       "generation_config.json) used instead of model.path's, e.g. for a random-init "
                                       "model: engines serve text and the OpenAI API with it, plug-in tasks with a "
                                       "tokenizer_path parameter receive it, checkpoints copy it into hf/")
    init_seed: int = Field(0, description="seed of the random init when model.path is unset (the trainer and the "
                           "embedded engines build the same weights from it)")
    init_std: float = Field(0.02, gt=0, description="standard deviation of the random init's normal weights "
                            "(model.path unset)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the trainer's parameter "
                                                             "and compute dtype (the engines' is engine.dtype)")

    def arch(self) -> MoEArch:
        if self.path:
            return MoEArch.from_hf_dir(self.path)
        return MoEArch(**{k: getattr(self, k) for k in MoEArch.model_fields})


class PoolsConfig(Strict):
    """How many ranks of the torchrun world train and how many host embedded engines."""

    trainer: int = Field(1, ge=1, description="number of trainer ranks")
    rollout: int = Field(1, ge=0, description="number of ranks hosting embedded engines")
    nnodes: int = Field(1, ge=1, description="nodes of the torchrun world; > 1: start `torchrun --nnodes N --nproc-per-node G ... -m moe_rl.launch CONFIG` on every node (docs/multinode.md)")
    nproc_per_node: int | None = Field(None, ge=1, description="ranks per node; null = every rank on one node "
                                       "(pools.trainer + pools.rollout)")


class EngineConfig(Strict):
    """The rollout engines: moe-rl's embedded engine or SGLang servers, both driven over SGLang's HTTP API
    (docs/sglang.md, docs/serving.md)."""

    kind: Literal["embedded", "sglang"] = Field("embedded", description="embedded: moe-rl's own engine in the "
                                               "pools.rollout ranks of the torchrun world; sglang: SGLang servers, "
                                               "attached (engine.urls) or launched (engine.sglang_model_path) "
                                               "(docs/sglang.md)")
    urls: list[str] = Field([], description="base URLs of running SGLang-API servers to use as rollout engines "
                            "(http://host:port), beside any embedded ones")
    host: str = Field("127.0.0.1", description="address an embedded engine's HTTP server binds (and a launched "
                      "SGLang server's --host); 0.0.0.0 to reach it from other machines")
    port: int = Field(30000, ge=0, le=65535, description="port of the first engine: embedded engine i listens "
                      "on port + i; 0 = a free port each (embedded engines only; a launched SGLang server needs "
                      "a fixed one)")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' on every request to the "
                                "engines (and send it); null = no key")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the engines' weight and "
                                                             "compute dtype; weight syncs are sent in it")
    max_running_requests: int = Field(64, ge=1, description="requests decoded together (KV-cache slots of an "
                                      "embedded engine; SGLang's --max-running-requests)")
    max_context: int = Field(512, ge=8, description="longest sequence (prompt + response) an engine holds, in "
                             "tokens; also the default episode budget (env.max_episode_tokens)")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds a request to an engine may take before "
                                     "the engine is treated as frozen and its requests go to the others")
    connect_retries: int = Field(3, ge=0, description="retries, with backoff, of a request whose TCP connection "
                                 "could not be made")
    threads: int | None = Field(None, ge=1, description="torch threads of an embedded engine")
    weight_version: str = Field("0", description="weight_version an engine reports before its first update "
                                "(SGLang's --weight-version)")
    # decode steps of an embedded engine (moe_rl/engine/decode.py, docs/gpu.md); a launched SGLang
    # server takes its own flags through engine.sglang_extra_args (--cuda-graph-max-bs-decode, ...)
    cuda_graph: bool | None = Field(None, description="capture the decode step as one CUDA graph per batch-size "
                                    "bucket and replay it (SGLang's decode CUDA graphs); null = on where the engine "
                                    "runs on a GPU and its step reads nothing on the host (bf16 experts on sm_90+; "
                                    "checked at start), off on CPU")
    cuda_graph_max_bs: int | None = Field(None, ge=1, description="largest decode batch run with static shapes and "
                                          "captured (SGLang's --cuda-graph-max-bs); larger batches run eagerly; "
                                          "null = engine.max_running_requests")
    static_decode: bool | None = Field(None, description="decode-only steps padded to batch-size and context-length "
                                       "buckets, inputs in preallocated buffers (what a graph captures); "
                                       "null = as engine.cuda_graph")
    compile: bool = Field(False, description="torch.compile an embedded engine's static decode step (SGLang's "
                          "--enable-torch-compile): Inductor fuses the step's small ops before the CUDA graphs "
                          "capture it. Dynamic batch size and span; the 2 graphs dynamo makes (batch size 1 specialised) "
                          "are compiled at start (tens of seconds; minutes on a CPU). Needs engine.static_decode (on with "
                          "engine.cuda_graph); not "
                          "with true_on_policy (its exact kernels are not traceable)")
    # the HTTP server of an embedded engine (moe_rl/engine/limits.py, docs/serving.md)
    max_request_bytes: int | None = Field(None, ge=1024, description="largest request body an embedded engine's "
                                          "server reads; a larger one gets HTTP 413. null = sized from the model: "
                                          "1 MiB plus the larger of a /generate batch of max_running_requests prompts "
                                          "of max_context tokens at 32 bytes a token, and twice a weight update that "
                                          "lists every tensor of the model (docs/serving.md)")
    read_timeout_s: float = Field(30.0, gt=0, le=3600, description="seconds an embedded engine's server gives a "
                                  "client to send a request's headers (from connecting, or from its previous "
                                  "answer) and then its body (HTTP 408) before it closes the connection; also how "
                                  "long an idle keep-alive connection is kept. Keep it above the clients' keep-alive "
                                  "(EngineClient's: 4 s, below SGLang's 5 s; the agents' openai client over aiohttp: "
                                  "5 s)")
    max_waiting_requests: int | None = Field(4096, ge=0, description="requests queued beyond max_running_requests "
                                             "(waiting for a KV slot) before /generate answers HTTP 503 with "
                                             "Retry-After; passed to a launched SGLang server as "
                                             "--max-queued-requests; null = no bound")
    # kind=sglang, launched by moe-rl: arguments passed to `python -m sglang.launch_server`
    sglang_model_path: str | None = Field(None, description="engine.kind=sglang: the HF checkpoint the launched "
                                          "server loads; null = model.path")
    sglang_ep_size: int = Field(1, ge=1, description="engine.kind=sglang: expert-parallel size of a launched "
                                "server (--ep-size)")
    sglang_tp_size: int = Field(1, ge=1, description="engine.kind=sglang: tensor-parallel size of a launched "
                                "server (--tp-size)")
    sglang_extra_args: list[str] = Field([], description="engine.kind=sglang: further arguments of `python -m "
                                         "sglang.launch_server`, e.g. [--mem-fraction-static, '0.35']")


class RolloutConfig(Strict):
    """What the rollout pool samples for each training step, and how far it may run ahead of the trainer."""

    prompts_per_step: int = Field(8, ge=1, description="prompts (GRPO groups) per training step")
    group_size: int = Field(4, ge=1, description="samples per prompt (GRPO group)")
    max_new_tokens: int = Field(16, ge=1, description="response budget per sample, in tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the smallest set of tokens whose "
                         "probability reaches top_p; 1 = off")
    top_k: int = Field(-1, description="sample among the k most probable tokens; -1 = off")
    max_staleness: int = Field(2, ge=0, description="eta: the most policy versions a trained token may lag behind "
                               "the trainer (a token sampled by version v is trained on by version v + eta at the "
                               "latest; older groups are dropped, and counted); 0 = synchronous, generation waits "
                               "for each step")
    partial_rollout: Literal["abort", "in_place"] = Field("abort", description="not read by the rollout loop: "
                                                          "what a weight update does to in-flight requests is "
                                                          "sync.pause_mode. Only lora.sync=adapter with "
                                                          "engine.kind=sglang checks it (it needs abort)")
    reward_workers: int = Field(2, ge=1, description="threads scoring responses (reward functions run off the "
                                "rollout loop)")
    max_inflight_groups: int | None = Field(None, ge=1, description="groups generating at once at most; null = "
                                            "as many as the staleness bound allows")
    engine_retry_s: float = Field(300.0, ge=0, description="how long a generate request whose engine failed "
                                  "(refused, dropped, no answer, HTTP 5xx) is resubmitted to live engines; 0 = never")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and sample "
                                   "more until the step has prompts_per_step groups with signal")
    max_sampling_rounds: int = Field(3, ge=1, description="dynamic_sampling: rounds of sampling per step at most")


class ReplayConfig(Strict):
    """Routing replay (R3): the experts each token used in the engine, logged and replayed by the trainer."""

    enabled: bool = Field(True, description="routing replay (R3): the engines log the experts each token used and "
                          "the trainer replays them, so the trained policy routes as the sampling one did")
    stale: Literal["engine", "trainer"] = Field(
        "engine", description="a stale sample (made by older weights than the trainer's): engine = replay its "
        "engine routing like a fresh one's (R3 as slime and MILES do it); trainer = route it with the trainer's "
        "own router, as the decoupled objective's proximal policy would (docs/algorithms.md)")
    dir: str | None = Field(None, description="directory of the routing log; null = <output_dir>/routing")
    retention: bool = Field(True, description="drop the routing records no sample can still use (trained on or "
                            "dropped, and not in the buffer of the latest checkpoint): the log then holds a few "
                            "steps' worth however long the run (docs/run_safety.md); false keeps every record")


class SyncConfig(Strict):
    """The weight sync from the trainers to the engines after every step (docs/architecture.md)."""

    bucket_mb: float = Field(64.0, gt=0, description="size of a weight-sync bucket in MiB: the weights go to the "
                             "engines as packed buckets of at most this, one broadcast each")
    verify: bool = Field(False, description="the engines check a checksum of every bucket (embedded engines "
                         "only; SGLang drops the field): for debugging a transfer")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort", description="what a weight update does to requests in flight (SGLang's pause modes): abort = "
        "they end with their partial output and are resubmitted as prompt + partial output; retract = their KV "
        "cache is dropped and they are recomputed after the update; in_place = they keep their KV cache and continue "
        "on the new weights. Every token keeps the version that produced it")
    group_name: str = Field("moe_rl_weight_sync", description="name of the weight-sync process group the "
                            "engines join (SGLang's group_name)")
    port: int = Field(0, ge=0, le=65535, description="rendezvous port of the weight-sync group; 0 = a free port")
    bind_params: bool = Field(True, description="train.ep_size=1: the trainer's parameters live in the bucket "
                              "buffers, so a sync sends them without packing (not under a fused AdamW, fp32 on "
                              "CUDA, which takes only dense parameters)")
    master_address: str = Field("127.0.0.1", description="address of trainer rank 0 as the engines reach it "
                                "(the weight-sync group's rendezvous); set it for engines on other machines")
    timeout_s: float = Field(120.0, gt=0, description="seconds the weight-sync group's setup and each "
                             "broadcast may take before the sync fails")
    skip_down_engines: bool = Field(True, description="a sync leaves out an engine that cannot be reached "
                                    "(it serves no rollouts until a later sync reaches it) instead of failing")
    backend: Literal["auto", "nccl", "gloo", "ipc"] = Field(
        "auto", description="transport of the weight sync: auto = nccl with train.device=cuda, gloo on the CPU. "
        "NCCL cannot join two ranks on one GPU, so a trainer sharing its GPU with its engine uses gloo (CUDA "
        "buckets staged through host memory) or ipc (the engine maps the trainer's bucket by CUDA IPC; one "
        "machine, embedded engines) (docs/gpu.md)")


class PlacementConfig(Strict):
    """Which GPU each rank of a node uses (train.device=cuda); see moe_rl/placement.py."""

    gpus: list[int] | None = Field(None, description="GPU index of each local rank of a node (trainer ranks "
                                   "first, then engine ranks); null = one GPU per rank while there are enough, "
                                   "else trainers get their own GPUs and engine ranks share")
    mem_fraction_static: float = Field(0.4, gt=0, lt=1, description="share of its GPU's memory an embedded "
                                       "engine takes for weights + KV cache (SGLang's --mem-fraction-static); "
                                       "sets how many requests' KV cache fit")


class AlgoConfig(Strict):
    """Advantages, the policy loss and its corrections for stale and mismatched samples (docs/algorithms.md)."""

    advantage: Literal["grpo", "drgrpo", "rloo"] = Field(
        "grpo", description="advantage estimator over each prompt's group: grpo = reward minus the group mean "
        "(divided by the group's std with algo.std_normalize); drgrpo = minus the mean, never divided; rloo = "
        "minus the mean of the other samples (docs/algorithms.md)")
    std_normalize: bool = Field(True, description="grpo: divide the centred rewards by the group's standard "
                                "deviation")
    policy_loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo", description="ppo = per-token clipped ratio; gspo = one clipped ratio per sequence (the geometric "
        "mean of its tokens'); cispo = the clipped ratio as a stop-gradient weight of the log-prob "
        "(docs/algorithms.md)")
    clip_low: float = Field(0.2, ge=0, description="the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="the ratio is clipped above at 1 + clip_high (DAPO's "
                             "clip-higher)")
    tis_cap: float | None = Field(2.0, gt=0, description="truncated importance sampling cap; null = off")
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="behaviour correction pi_prox/pi_behav per token, or one weight per sequence "
        "(the product over its tokens, truncated at tis_cap): docs/algorithms.md")
    icepop_low: float | None = Field(0.5, gt=0, description="IcePop: tokens whose train/infer ratio "
                                     "pi_prox/pi_behav is below this are masked out of the loss; null = no lower "
                                     "bound")
    icepop_high: float | None = Field(2.0, gt=0, description="IcePop: tokens whose train/infer ratio is above "
                                      "this are masked out; null = no upper bound")
    ratio_anchor: Literal["proximal", "behaviour"] = Field(
        "proximal", description="the policy the ratio and its clip are taken against: the trainer before its "
        "update (decoupled PPO, corrected by the behaviour weight: TIS, IcePop), or the engine that sampled "
        "(coupled PPO, slime's --use-rollout-logprobs; the behaviour weight is then 1). behaviour keeps "
        "staleness from costing reward per sample with ppo; configs/tiny.yaml sets it (docs/algorithms.md)")
    loss_agg: Literal["token", "sequence", "token_sum_norm"] = Field(
        "token", description="how token losses make the step's loss: token = mean over every token of the "
        "step; sequence = mean over each sequence, then over sequences; token_sum_norm = sum over tokens divided "
        "by a constant (algo.loss_norm_tokens; Dr. GRPO)")
    loss_norm_tokens: int | None = Field(None, ge=1, description="token_sum_norm's constant divisor; "
                                         "null = rollout.max_new_tokens x sequences in the step")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong shaping: last tokens before "
                                 "rollout.max_new_tokens that are penalised; 0 = off")
    overlong_penalty: float = Field(1.0, ge=0, description="reward penalty of a response cut at max_new_tokens")
    kl_coef: float = Field(0.0, ge=0, description="weight of a per-token KL penalty (k3) against the initial policy, kept "
                      "frozen as a second model; 0 = off (no reference model)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus; 0 = off")


class TrainConfig(Strict):
    """The trainer: backend, device, optimizer, parallelism, compilation."""

    backend: Literal["native", "megatron"] = Field("native", description="native = moe-rl's torch trainer; "
                                                   "megatron = Megatron-core with expert parallelism "
                                                   "(pip install 'moe-rl[megatron]'; docs/megatron.md)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where trainers and embedded engines run: cpu "
                                           "(gloo) or cuda (one GPU per rank unless placement.gpus says; "
                                           "docs/gpu.md)")
    steps: int = Field(20, ge=1, description="training steps (optimizer updates of one rollout batch each) of "
                       "the run")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (constant)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon (Megatron's --adam-eps): the floor under "
                            "each coordinate's gradient scale. Raised, a coordinate whose gradient has shrunk "
                            "far below it moves by less than lr, so a saturated policy's vanishing gradients "
                            "are not blown up to full-size steps")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the gradient's global norm to this; null = "
                                    "no clipping")
    micro_batch_size: int = Field(8, ge=1, description="sequences per micro-batch")
    minibatches: int = Field(1, ge=1, description="optimizer updates per rollout batch (slime's "
                             "num_steps_per_rollout, AReaL's ppo_n_minibatches): the batch is split into this "
                             "many minibatches; weights sync, and the version advances, once per batch")
    ep_size: int = Field(1, ge=1, description="expert-parallel size of the trainer pool: experts sharded over "
                         "this many ranks (pools.trainer a multiple of it)")
    tp_size: int = Field(1, ge=1, description="tensor-parallel size (train.backend=megatron only; > 1 is "
                         "refused for now, docs/megatron.md)")
    threads: int | None = Field(None, ge=1, description="torch threads of a trainer rank")
    seed: int = Field(0, description="torch seed of the trainer (and Megatron's parallel RNG state)")
    fused_loss: Literal["auto"] | bool = Field(
        "auto", description="the policy loss fused into the LM-head kernel (moe_rl.kernels.fused_token_loss: "
        "d_hidden and d_weight made in the forward, 3 GEMMs instead of 4): auto = when algo's loss is per-token "
        "(not gspo, not tis_level=sequence with ratio_anchor=proximal), else the general path; true = refuse a "
        "loss that is not; false = always the general path (docs/algorithms.md)")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each decoder block of the native model (fullgraph, dynamic shapes; "
        "docs/gpu.md 'Compiled training step'): auto = on with train.device=cuda and train.ep_size=1 (the "
        "all-to-all's split sizes are host integers), off on the CPU (the compile costs more than a CPU run saves: "
        "docs/benchmarks.md); "
        "true = refuse what cannot be compiled; false = eager. train.backend=megatron: no effect (docs/megatron.md)")
    cuda_graphs: bool = Field(False, description="the compiled decoder blocks replayed as CUDA graphs "
                              "(torch.compile's reduce-overhead mode: CUDA graph trees, forward and backward). A "
                              "micro-batch of a few thousand tokens launches ~70 kernels per block, whose host cost "
                              "bounds the step on a GPU (docs/gpu.md 'Compiled training step'); each distinct "
                              "micro-batch length is one more recording, so train.token_bucket rounds the lengths "
                              "up. Needs the compiled blocks on CUDA: train.device=cuda, train.compile not false, "
                              "train.ep_size=1, the native backend")
    token_bucket: int = Field(0, ge=0, description="pad each micro-batch's packed row up to a multiple of this "
                              "many tokens (a filler sequence: no loss, no expert load; 0 = no padding): bounds the "
                              "distinct lengths train.cuda_graphs records. 0 with train.cuda_graphs: 1024")
    expert_bias_update_rate: float = Field(0.0, ge=0, description="sigmoid routers (GLM, DeepSeek): 0 = the "
                                           "expert-score correction bias stays frozen; > 0 = after each optimizer "
                                           "step bias += rate * sign(mean load - load), DeepSeek-V3's rule "
                                           "(docs/models.md)")
    megatron_use_te: bool | None = Field(None, description="train.backend=megatron: Transformer Engine layer "
                                         "specs; null = when transformer_engine imports (docs/megatron.md)")
    megatron_grouped_gemm: bool | None = Field(None, description="train.backend=megatron: grouped experts "
                                               "(TEGroupedMLP with TE, else TorchGroupedMLP); false = "
                                               "SequentialMLP, a loop over experts; null = true")
    megatron_dispatcher: Literal["alltoall", "allgather"] = Field("alltoall", description="train.backend="
                                                                  "megatron: Megatron's token dispatcher")
    megatron_router_fusion: bool = Field(False, description="train.backend=megatron: TE's fused top-k router; "
                                         "refused while replay.enabled (it would skip the replayed routing)")
    megatron_recompute: bool = Field(False, description="train.backend=megatron: full activation recompute, one "
                                     "layer per checkpoint (routing replayed in the recompute too)")

    @property
    def micro_batch_bucket(self) -> int:
        """The multiple micro-batch lengths are padded to: train.token_bucket, or 1024 where
        train.cuda_graphs leaves it 0."""
        return self.token_bucket or (1024 if self.cuda_graphs else 0)


class DataConfig(Strict):
    """The prompts: a shipped task, a dataset file or a plug-in task (docs/environments.md)."""

    task: str = Field("reverse", description="the task: a shipped one (echo, copy, reverse: tiny-model tasks; "
                      "jsonl: math problems at data.path scored by math-verify; arith: jsonl on a shipped "
                      "48-problem file; guess: guess the number, multi-turn) or a plug-in 'package.module:factory' "
                      "(docs/environments.md)")
    path: str | None = Field(None, description="the dataset of data.task=jsonl: a JSONL or Parquet file or a "
                             "datasets directory (data.format)")
    seed: int = Field(0, description="seed of the prompt order and of sampling: prompt i is drawn from "
                      "(data.seed, i) and each request's sampling seed from it, so a resumed run draws as an "
                      "uninterrupted one")
    task_args: dict[str, Any] = Field({}, description="keyword arguments of the task (or of a plug-in task's "
                                      "factory); an unknown one is an error naming the accepted ones")
    # file-backed tasks (data.task: jsonl) read datasets as verl and slime users have them (docs/coming_from_verl_slime.md)
    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = Field(
        "auto", description="how data.path is read: jsonl (one JSON object per line), parquet (verl's files), hf_disk "
        "(a directory written by datasets' save_to_disk); auto = hf_disk for a directory, parquet for a .parquet "
        "file, else jsonl")
    prompt_key: str | None = Field(None, description="the field holding each row's prompt, a string or a list of "
                                   "chat messages (slime's --input-key); dotted for a nested field; null = the first "
                                   "of prompt, question, problem")
    answer_key: str | None = Field(None, description="the field holding each row's reference answer (slime's "
                                   "--label-key); dotted for a nested field (reward_model.ground_truth); null = the "
                                   "first of answer, solution, reward_model.ground_truth")


_PLUGIN_HELP = "an import path 'package.module:name'"


def _check_plugin_path(value: str | None) -> str | None:
    if value is not None:
        mod, sep, name = value.partition(":")
        if not sep or not mod or not name.isidentifier():
            raise ValueError(f"{value!r} is not {_PLUGIN_HELP}")
    return value


class RewardConfig(Strict):
    """A user's reward function (docs/environments.md): ``fn(prompt, response_ids, response_text)``,
    sync or async, returning a float or a dict with a float ``reward`` and other numeric metrics."""

    fn: str | None = Field(None, description=f"reward plug-in, {_PLUGIN_HELP}; replaces the task's reward")

    _check = field_validator("fn")(classmethod(lambda cls, v: _check_plugin_path(v)))


class EnvConfig(Strict):
    """Multi-turn environments (docs/environments.md): every sample is an episode of model turns
    and environment turns, kept as one token sequence."""

    factory: str | None = Field(None, description=f"environment plug-in, {_PLUGIN_HELP}: called once per "
                                "episode with env.args (and task=, if it takes one), returns the environment")
    args: dict[str, Any] = Field({}, description="keyword arguments passed to env.factory (or to env.openai_agent) "
                                 "for every episode")
    max_turns: int = Field(4, ge=1, description="model turns per episode")
    max_new_tokens_per_turn: int | None = Field(None, ge=1, description="response budget of one model turn, in "
                                                "tokens; null = rollout.max_new_tokens")
    max_episode_tokens: int | None = Field(None, ge=2, description="token budget of a whole episode (prompt and "
                                           "every turn); null = engine.max_context")
    episode_timeout_s: float = Field(300.0, gt=0, description="an episode running longer is marked failed")
    max_concurrent_episodes: int = Field(64, ge=1, description="episodes in flight at once (all groups)")
    openai_agent: str | None = Field(None, description=f"agent plug-in, {_PLUGIN_HELP}: an async function "
                                     "agent(client, prompt, **env.args) called once per episode with an "
                                     "openai.AsyncOpenAI client scoped to the episode; returns the reward (a float, "
                                     "or a dict with 'reward' and numeric metrics). docs/environments.md, 'Agents'")
    agent_workers: int | None = Field(None, ge=0, description="processes that play env.openai_agent's episodes, "
                                      "each with its own event loop, so the agents' client work (about 1 ms of CPU "
                                      "a chat call with the openai SDK) takes no CPU from the trainer's process; "
                                      "env.max_concurrent_episodes is split among them. null = one per 8 CPU cores "
                                      "the trainer may run on, 1 to 4. 0 = in the rollout manager's thread (the "
                                      "agent's module state then lives in the trainer's process)")
    agent_gateway: Literal["auto"] | bool = Field(
        "auto", description="where env.openai_agent's chat calls are served: true = each agent worker's own OpenAI "
        "gateway renders the chat template, parses tool calls and records the episodes, and the engines only "
        "generate from token ids (/generate), so that work runs in the workers rather than in the engine's "
        "process; false = the embedded engine's own endpoints; auto = true for engine.kind=sglang (which has no "
        "episode endpoints), false for embedded. Needs a tokenizer (model.tokenizer_path or model.path) and "
        "lora.sync=merged where LoRA is on. docs/environments.md, 'Agents'")

    _check = field_validator("factory", "openai_agent")(classmethod(lambda cls, v: _check_plugin_path(v)))

    def agent_worker_count(self, cpus: int | None = None) -> int:
        """env.agent_workers, or where it is null one worker per 8 CPU cores (1 to 4): one worker's
        event loop keeps up with ~900 chat calls a second, and a machine with cores to spare lets
        several run beside the trainer and the engines."""
        if self.agent_workers is not None:
            return self.agent_workers
        if cpus is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(4, cpus // 8))

    def uses_gateway(self, engine_kind: str) -> bool:
        """Whether the agent workers serve the chat calls through their own gateway (env.agent_gateway)."""
        return engine_kind == "sglang" if self.agent_gateway == "auto" else self.agent_gateway


class LoggingConfig(Strict):
    """What a run logs besides metrics.jsonl (written always): TensorBoard, W&B, MLflow, the console."""

    progress: bool = Field(True, description="a progress bar of the steps on the trainer's terminal")
    tensorboard: bool = Field(True, description="TensorBoard logs in <output_dir>/tensorboard beside "
                              "metrics.jsonl")
    log_every: int = Field(1, ge=1, description="not read: every step is logged to metrics.jsonl and the "
                           "trackers")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Python log level of every "
                                                                "rank and of moe-rl serve")
    # trackers beside TensorBoard (moe_rl/train/tracking.py): trainer rank 0 logs what metrics.jsonl holds
    wandb: bool = Field(False, description="also log to Weights & Biases (pip install 'moe-rl[wandb]'); W&B's own "
                        "environment variables apply (WANDB_MODE=offline, WANDB_DIR, WANDB_API_KEY, WANDB_BASE_URL, ...)")
    mlflow: bool = Field(False, description="also log to MLflow (pip install 'moe-rl[mlflow]'); the store is "
                         "MLFLOW_TRACKING_URI, MLflow's own default when unset")
    project: str | None = Field(None, description="W&B project and MLflow experiment; null = WANDB_PROJECT / "
                                "MLFLOW_EXPERIMENT_NAME when set, else the config's name")
    run_name: str | None = Field(None, description="the run's name in W&B and MLflow; null = output_dir's last part")
    tags: list[str] = Field([], description="tags of the run in W&B and MLflow")


class CheckpointConfig(Strict):
    """Checkpoints in <output_dir>/checkpoints: an hf/ model directory and the trainer state to resume from
    (docs/run_safety.md)."""

    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk; older ones are deleted once a newer one "
                      "is complete")


class LoraConfig(Strict):
    """LoRA adapters (moe_rl.model.lora): base weights frozen, only adapters trained and synced."""

    enabled: bool = Field(False, description="train LoRA adapters on frozen base weights (setting lora.rank alone "
                          "also turns it on, as in verl; docs/lora.md)")
    rank: int = Field(16, ge=1, description="adapter rank r (0 in a config given without lora.enabled means off, "
                      "as in verl)")
    alpha: float = Field(32.0, gt=0, description="adapter scale: the update is (alpha / rank) B A")
    dropout: float = Field(0.0, ge=0, le=0, description="must be 0: adapter dropout is not implemented")
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "router", "experts.gate_up_proj",
                          "experts.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                          "shared_experts.down_proj",
                          # multi-head latent attention (deepseek_v3, glm4_moe_lite)
                          "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                          # Gated DeltaNet's projections (Qwen3-Next: in_proj_qkvz/ba; Qwen3.5: in_proj_qkv/z/b/a)
                          "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                          "out_proj"]] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"],
        description="weights to adapt; attention targets are the projections of the model's attention (MLA models: "
                    "q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; Gated DeltaNet layers: "
                    "in_proj_qkvz, in_proj_ba (Qwen3-Next) or in_proj_qkv, in_proj_z, in_proj_b, in_proj_a "
                    "(Qwen3.5), out_proj)")
    layers: list[int] | None = Field(None, description="indices of the decoder layers to adapt; null = all")
    seed: int = Field(0, description="seed of the adapters' init (A random, B zero)")
    sync: Literal["adapter", "merged"] = Field("merged", description="what a weight sync sends: the adapter "
                                               "tensors only, or the full merged weights")
    experts_shared_outer: bool = Field(False, description="one A of experts.gate_up_proj and one B of "
                                       "experts.down_proj per layer, shared by its experts (SGLang's shared-outer "
                                       "MoE LoRA); the expert-width factors stay per expert")

    @model_validator(mode="before")
    @classmethod
    def _rank_turns_lora_on(cls, data: Any) -> Any:
        """verl's convention (``lora_rank > 0`` is what turns LoRA on): ``lora.rank`` given
        without ``lora.enabled`` enables the adapters, and says so; a rank of 0 is verl's off."""
        if isinstance(data, dict) and data.get("rank") == 0 and "enabled" not in data:
            data = {k: v for k, v in data.items() if k != "rank"}
        if isinstance(data, dict) and "rank" in data and "enabled" not in data:
            log.warning("lora.rank=%s is set and lora.enabled is not: LoRA is on (lora.enabled=true), as in verl, "
                        "where a LoRA rank turns it on", data["rank"])
            data = {**data, "enabled": True}
        return data

    @model_validator(mode="after")
    def _settings_need_lora(self) -> "LoraConfig":
        """Other lora.* keys alone would train without adapters, silently: refused. An explicit
        ``lora.enabled: false`` keeps them (a sweep arm without LoRA, a dumped config)."""
        given = sorted(self.model_fields_set - {"enabled"})
        if given and not self.enabled and "enabled" not in self.model_fields_set:
            keys = ", ".join(f"lora.{k}" for k in given)
            raise ValueError(f"{keys} set but lora.enabled is false (its default), so no adapter would train: set "
                             f"lora.enabled=true (or lora.rank, which turns LoRA on as in verl), or drop {keys}")
        return self

class SweepConfig(Strict):
    """``moe-rl sweep``: arms = the cross product of ``grid`` (config key -> values), each run
    once per seed (docs/experiments.md). ``moe-rl train`` ignores this section."""

    grid: dict[str, list[Any]] = Field({}, description="config key -> values; the arms are their cross product "
                                       "(--grid KEY=V1,V2 on the command line replaces a key's entry)")
    seeds: int = Field(1, ge=1, description="runs per arm, seeds 0..seeds-1 (seed, train.seed, data.seed, model.init_seed)")
    steps: int | None = Field(None, ge=1, description="train.steps of every run; None = the config's")
    threshold: float = Field(0.5, description="reward whose first crossing (trailing mean) is 'steps to threshold'")
    parallel: int = Field(1, ge=1, description="runs at a time (each is a whole torchrun world)")
    output_dir: str | None = Field(None, description="the sweep's directory (its runs, summary.md, plots); "
                                   "null = <output_dir>/sweep")
    overrides: list[str] = Field([], description="key=value overrides applied to every run, e.g. "
                                 "data.task_args.long_tail=true")
    final_eval: bool = Field(False, description="score each run's final checkpoint as the eval section says "
                             "(eval.prompts, eval.samples, eval.temperature, eval.data; moe_rl/experiments/evaluate.py)")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and {"eval_prompts", "eval_samples"} & set(data):
            raise ValueError("sweep.eval_prompts and sweep.eval_samples are now the eval section's: set "
                             "sweep.final_eval=true with eval.prompts and eval.samples")
        return data


class DistConfig(Strict):
    """How long the ranks of the torchrun world wait for one another (docs/run_safety.md, "Long runs")."""

    timeout_s: float = Field(1800.0, gt=0, description="timeout of the trainer pool's collectives whose ranks "
                             "arrive together (gradient all-reduce, expert all-to-all): its process groups' timeout")
    wait_timeout_s: float = Field(86400.0, gt=0, description="bound of the collectives where ranks wait long for "
                                  "one of them: every rank at the start while the models load (the world's default "
                                  "group), the trainer ranks for rank 0's rollouts, checkpoint writes and weight "
                                  "syncs (groups of their own). A frozen rank ends the run sooner (peer_timeout_s)")
    peer_timeout_s: float = Field(300.0, gt=0, description="a rank whose heartbeat stops this long is frozen "
                                  "(stopped or hung): the rank watching it ends the run with an error naming it")


class FaultConfig(Strict):
    """Fault injection for the run-safety suite (moe_rl/faults.py, docs/run_safety.md): when the
    named point is reached the ``at``-th time in a process (of ``rank``, or any), ``action``
    happens there. Off (``point: null``) in every real run."""

    point: Literal["engine.generate", "sync.bucket", "engine.update", "checkpoint.write", "routing.append"] | None = Field(
        None, description="where the fault fires: engine.generate (an engine receives a /generate), sync.bucket "
        "(trainer rank 0 has posted a bucket's broadcast), engine.update (an engine receives a bucket), "
        "checkpoint.write (a checkpoint file before its rename), routing.append (a routing record before its "
        "index entry); null = off, as in every real run")
    at: int = Field(1, ge=1, description="fire on the at-th time the point is reached in a process")
    action: Literal["kill_tree", "kill", "stop", "enospc"] = Field(
        "kill_tree", description="kill_tree: SIGKILL the launcher and every process under it at once; kill: SIGKILL "
        "this process; stop: SIGSTOP this process (it freezes); enospc: fail the write with OSError(ENOSPC) "
        "(checkpoint.write only)")
    rank: int | None = Field(None, ge=0, description="the global rank where it fires; None = any rank reaching it")


class EvalConfig(Strict):
    """Evaluation on held-out prompts (moe_rl/rollout/evaluation.py, docs/experiments.md): during training
    on the rollout engines at the current weights, and the sweeps' final-checkpoint evaluation."""

    every: int = Field(0, ge=0, description="evaluate after every this many steps, and after the last; 0 = never "
                       "during training")
    prompts: int = Field(64, ge=1, description="prompts per evaluation (all of eval.data's when it holds fewer)")
    samples: int = Field(4, ge=1, description="responses per prompt: pass@1 and pass@{samples} are reported")
    temperature: float | None = Field(None, ge=0, description="sampling temperature; null = rollout.temperature, "
                                      "0 = greedy")
    data: str | None = Field(None, description="held-out dataset for data.task=jsonl, read like data.path (same "
                             "data.format, prompt_key, answer_key); null = the training task's prompts drawn with a "
                             "seed no training run draws with")
    pass_threshold: float = Field(1.0, description="a response passes (pass@k) when its reward is at least this")


class ExperimentConfig(Strict):
    """A whole experiment: the keys at the top level, then one section per part."""

    name: str = Field("moe-rl", description="the experiment's name: the W&B project / MLflow experiment when "
                      "logging.project and their environment variables are unset")
    output_dir: str = Field("runs/default", description="the run's directory: metrics.jsonl, TensorBoard logs, "
                            "checkpoints, the routing log, the reward curve; one run writes into it at a time "
                            "(docs/run_safety.md)")
    resume: bool = Field(False, description="continue the run in output_dir from its latest checkpoint")
    overwrite_output_dir: bool = Field(False, description="start over in an output_dir that holds a run: its "
                                       "metrics, checkpoints, routing log and TensorBoard logs are deleted first")
    seed: int = Field(0, description="the experiment's seed as moe-rl sweep sets it per run (with train.seed, "
                      "data.seed and model.init_seed, which are what a run draws from)")
    model: ModelConfig = ModelConfig()
    pools: PoolsConfig = PoolsConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    replay: ReplayConfig = ReplayConfig()
    sync: SyncConfig = SyncConfig()
    placement: PlacementConfig = PlacementConfig()
    algo: AlgoConfig = AlgoConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    env: EnvConfig = EnvConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoraConfig = LoraConfig()
    dist: DistConfig = DistConfig()
    fault: FaultConfig = FaultConfig()
    eval: EvalConfig = EvalConfig()

    sweep: SweepConfig = SweepConfig()
    true_on_policy: bool = Field(
        False, description="engine and trainer compute with one set of batch-invariant kernels (moe_rl.kernels.exact), "
        "so a token's log-prob is the same bits in the embedded engine (alone or batched, prefill or decode) and in "
        "the trainer's forward: at staleness 0 mismatch_k3 is 0, and minibatches after the first need no proximal "
        "forward. Costs engine and trainer speed (docs/true_on_policy.md); needs train.backend=native, equal "
        "model.dtype and engine.dtype (float32 or bfloat16), lora.sync=adapter with LoRA, train.compile not true. "
        "With engine.kind=sglang the trainer's side only: the mismatch metrics report what is left")

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        if self.resume and self.overwrite_output_dir:
            raise ValueError("resume=true continues the run in output_dir, overwrite_output_dir=true deletes it: "
                             "set one of them")
        if self.fault.action == "enospc" and self.fault.point not in (None, "checkpoint.write"):
            raise ValueError(f"fault.action=enospc fails a checkpoint write: it needs fault.point=checkpoint.write, "
                             f"not {self.fault.point}")
        if self.train.expert_bias_update_rate and not self.model.path and self.model.router != "sigmoid":
            raise ValueError(f"train.expert_bias_update_rate is set but model.model_type={self.model.model_type!r} has "
                             "no expert-score correction bias (a sigmoid router's)")
        if self.train.compile is True and self.train.ep_size > 1 and self.train.backend == "native":
            raise ValueError("train.compile=true with train.ep_size > 1: expert parallelism reads the all-to-all "
                             "split sizes on the host, which a compiled block cannot; set train.compile to auto "
                             "(off with EP) or false")
        t = self.train
        if t.cuda_graphs:
            why = ("train.device=cpu" if t.device != "cuda" else "train.compile=false" if t.compile is False
                   else "train.ep_size > 1" if t.ep_size > 1 else "train.backend=megatron" if t.backend != "native"
                   else "true_on_policy (its blocks run eagerly)" if self.true_on_policy else None)
            if why:
                raise ValueError(f"train.cuda_graphs=true replays the compiled decoder blocks on a GPU, and {why} "
                                 "here; set train.cuda_graphs=false")
        if self.pools.trainer % self.train.ep_size:
            raise ValueError(f"pools.trainer={self.pools.trainer} must be a multiple of train.ep_size={self.train.ep_size}")
        if not self.model.path and self.model.num_experts % self.train.ep_size:
            raise ValueError(f"model.num_experts={self.model.num_experts} is not divisible by train.ep_size={self.train.ep_size}")
        if self.engine.kind == "embedded" and self.pools.rollout < 1:
            raise ValueError("engine.kind=embedded needs pools.rollout >= 1")
        if self.engine.cuda_graph and self.engine.kind == "embedded" and self.train.device != "cuda":
            raise ValueError("engine.cuda_graph=true needs the embedded engine on a GPU, and it runs on the CPU here "
                             "(train.device=cpu); set train.device=cuda, or leave engine.cuda_graph unset (on where "
                             "the engine is on a GPU)")
        e = self.engine
        static = e.static_decode if e.static_decode is not None else (
            e.cuda_graph if e.cuda_graph is not None else self.train.device == "cuda")
        if e.compile and e.kind == "embedded" and not static:
            raise ValueError("engine.compile=true compiles the static decode step, and it is off here; set "
                             "engine.static_decode=true (or leave it unset with engine.cuda_graph on a GPU)")
        if self.engine.cuda_graph and self.engine.static_decode is False:
            raise ValueError("engine.cuda_graph=true with engine.static_decode=false: the graphs capture the "
                             "static-shape decode step; leave engine.static_decode unset or true")
        if self.engine.kind == "sglang" and not self.engine.urls and not self.engine.sglang_model_path:
            raise ValueError("engine.kind=sglang needs engine.urls (attach) or engine.sglang_model_path (launch)")
        if self.train.minibatches > self.rollout.prompts_per_step * self.rollout.group_size:
            raise ValueError(f"train.minibatches={self.train.minibatches} exceeds the samples of a step "
                             f"(rollout.prompts_per_step x group_size = {self.rollout.prompts_per_step * self.rollout.group_size})")
        if self.algo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer={self.algo.overlong_buffer} exceeds "
                             f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
        if self.placement.gpus is not None and self.train.device != "cuda":
            raise ValueError("placement.gpus is set but train.device is not cuda")
        if self.placement.gpus is not None and len(self.placement.gpus) != (self.pools.nproc_per_node or self.world_size):
            raise ValueError(f"placement.gpus has {len(self.placement.gpus)} entries; it needs one per local rank "
                             f"({self.pools.nproc_per_node or self.world_size}: pools.nproc_per_node, default "
                             f"pools.trainer + pools.rollout)")
        if self.sync.backend == "ipc" and self.engine.kind != "embedded":
            raise ValueError("sync.backend=ipc is moe-rl's own same-machine transfer: it needs engine.kind=embedded")

        if self.env.openai_agent and self.env.factory:
            raise ValueError("env.openai_agent and env.factory: an episode is played either by an OpenAI-API agent or "
                             "by a token-level environment; set one of them")
        gateway = self.env.openai_agent and self.env.uses_gateway(self.engine.kind)
        why = "engine.kind=sglang" if self.engine.kind == "sglang" else "env.agent_gateway=true"
        if self.env.openai_agent and self.engine.kind == "sglang" and not gateway:
            raise ValueError("env.openai_agent with engine.kind=sglang and env.agent_gateway=false: SGLang has no "
                             "episode endpoints, so the agent workers' gateways serve the calls; set "
                             "env.agent_gateway to auto or true")
        if gateway and not (self.model.tokenizer_path or self.model.path or self.engine.sglang_model_path):
            raise ValueError(f"env.openai_agent with {why}: the agent workers render the chat "
                             "template before the engine (docs/environments.md); set model.tokenizer_path or "
                             "model.path")
        if gateway and self.lora.enabled and self.lora.sync == "adapter":
            raise ValueError(f"env.openai_agent with {why} and lora.sync=adapter: the engine serves "
                             "each synced adapter under a new name, which the agent workers' gateways do not "
                             "follow; use lora.sync=merged")
        if self.reward.fn and self.env.openai_agent:
            raise ValueError("reward.fn and env.openai_agent: the agent returns the episode's reward; score inside "
                             "the agent (or drop env.openai_agent)")
        if self.reward.fn and self.env.factory:
            raise ValueError("reward.fn and env.factory: an episode's reward is the sum of its environment's step "
                             "rewards; score inside the environment (or drop env.factory)")

        if self.lora.enabled and self.train.backend == "megatron" and self.train.megatron_recompute:
            raise ValueError("lora.enabled with train.megatron_recompute=true: the recomputed forward would read "
                             "the base weights, not the adapted ones; set train.megatron_recompute=false")
        if self.lora.enabled and self.train.backend == "megatron" and self.train.tp_size > 1:
            raise ValueError("lora.enabled with train.backend=megatron needs train.tp_size=1 (adapters on "
                             "TP-sharded weights are not implemented)")
        if self.lora.enabled and self.lora.layers is not None and any(
                not 0 <= i < self.model.num_hidden_layers for i in self.lora.layers):
            raise ValueError(f"lora.layers {self.lora.layers}: indices must be in [0, model.num_hidden_layers)")
        if self.lora.enabled and self.lora.experts_shared_outer and self.train.ep_size > 1:
            raise ValueError("lora.experts_shared_outer needs train.ep_size=1 (the shared factors' gradients "
                             "would need a reduction over the EP group)")
        if self.lora.enabled and self.lora.sync == "adapter" and self.engine.kind == "sglang":
            self._check_sglang_lora()
        if self.data.task == "jsonl" and not self.data.path:
            raise ValueError("data.task=jsonl needs data.path")
        file_keys = [f"data.{k}" for k, unset in (("format", "auto"), ("prompt_key", None), ("answer_key", None))
                     if getattr(self.data, k) != unset]
        if file_keys and self.data.task != "jsonl":
            raise ValueError(f"{', '.join(file_keys)} set, but they apply to data.task=jsonl (a dataset file), "
                             f"not {self.data.task!r}")
        if self.eval.data and self.data.task != "jsonl":
            raise ValueError(f"eval.data is a held-out dataset for data.task=jsonl; data.task is {self.data.task!r} "
                             "(its evaluation draws the task's own prompts: leave eval.data unset)")
        if self.true_on_policy:
            self._check_true_on_policy()
        if self.eval.every and self.env.factory:
            raise ValueError("eval.every with env.factory: evaluation runs single-turn prompts; multi-turn episodes "
                             "are not evaluated (set eval.every=0)")
        return self

    def _check_true_on_policy(self) -> None:
        """true_on_policy: what has an exact path (docs/true_on_policy.md)."""
        where = "true_on_policy=true"
        if self.train.backend != "native":
            raise ValueError(f"{where} needs train.backend=native (Megatron's kernels are not the engine's)")
        if self.model.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"{where}: model.dtype={self.model.dtype}; the exact kernels take float32 or bfloat16")
        if self.engine.kind == "embedded" and self.engine.dtype != self.model.dtype:
            raise ValueError(f"{where}: engine.dtype={self.engine.dtype} and model.dtype={self.model.dtype} differ; "
                             "the engine must compute in the trainer's dtype to give its bits")
        if self.train.compile is True:
            raise ValueError(f"{where} with train.compile=true: the exact kernels are not custom ops torch.compile "
                             "can trace; set train.compile to auto (off under true_on_policy) or false")
        if self.engine.compile and self.engine.kind == "embedded":
            raise ValueError(f"{where} with engine.compile=true: the exact kernels are not custom ops torch.compile "
                             "can trace; set engine.compile=false")
        if self.lora.enabled and self.lora.sync != "adapter":
            raise ValueError(f"{where} with LoRA needs lora.sync=adapter: merged weights (W + s*B@A in one matrix) "
                             "round differently from the trainer's unmerged adapter")
        if self.model.model_type == "gpt_oss":
            raise ValueError(f"{where}: model.model_type=gpt_oss has no exact path (attention sinks, sliding windows, "
                             "biased experts with a clamped GLU are torch's arithmetic)")
        if not self.model.path:
            from .model.attention import MIXERS

            kinds = sorted({k for k in self.model.arch().layer_kinds() if not MIXERS[k].exact_path})
            if kinds:
                raise ValueError(f"{where}: model.model_type={self.model.model_type} has attention kinds without an "
                                 f"exact path: {kinds}")

    def _check_sglang_lora(self) -> None:
        """lora.sync=adapter with SGLang servers (moe_rl.sync.adapter_files, docs/lora.md)."""
        where = "lora.sync=adapter with engine.kind=sglang"
        if "router" in self.lora.targets:
            raise ValueError(f"{where}: lora.targets has 'router'; SGLang's per-expert adapter files carry no router "
                             "adapter (drop 'router', or use lora.sync=merged)")
        shared = [t for t in self.lora.targets if t.startswith("shared_experts.")]
        if shared:
            raise ValueError(f"{where}: lora.targets has {shared}; serving shared-expert adapters through SGLang's "
                             "LoRA files is not checked against SGLang yet (use lora.sync=merged)")
        experts = [t for t in self.lora.targets if t.startswith("experts.")]
        if experts and self.model.model_type == "gpt_oss":
            raise ValueError(f"{where}: lora.targets has {experts}; gpt-oss's experts are one [E, in, out] tensor, "
                             "which SGLang's per-expert adapter files cannot carry (use lora.sync=merged)")
        mla = [t for t in self.lora.targets if t in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")]
        if mla:
            raise ValueError(f"{where}: lora.targets has {mla}; serving latent-attention adapters through SGLang's "
                             "LoRA files is not checked against SGLang (use lora.sync=merged)")
        qkv = {"q_proj", "k_proj", "v_proj"} & set(self.lora.targets)
        if qkv and not {"q_proj", "v_proj"} <= qkv:
            raise ValueError(f"{where}: lora.targets has {sorted(qkv)}; SGLang stacks q/k/v adapters into qkv_proj "
                             "only when q_proj and v_proj are both adapted (k_proj may be left out)")
        if self.train.ep_size > 1:
            raise ValueError(f"{where}: needs train.ep_size=1 (the adapter file holds every expert; EP shards "
                             "are not gathered yet)")
        if self.rollout.partial_rollout != "abort":
            raise ValueError(f"{where}: needs rollout.partial_rollout=abort (SGLang keeps an in-flight request "
                             "on the adapter it started with, so in_place would mix versions untagged)")

    @property
    def world_size(self) -> int:
        """Ranks of the torchrun world: trainers, then embedded-engine hosts."""
        rollout = self.pools.rollout if self.engine.kind == "embedded" else 0
        return self.pools.trainer + rollout


# --- loading ------------------------------------------------------------------------------
def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _model_at(path: tuple) -> type[BaseModel] | None:
    cls: Any = ExperimentConfig
    for part in path:
        field = getattr(cls, "model_fields", {}).get(part) if isinstance(part, str) else None
        if field is None:
            return None
        cls = field.annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            known = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?)" if close else ""
            lines.append(f"  {key}: unknown key{hint}")
        elif not loc:  # a cross-field check: its message names the keys itself
            lines.append("  " + e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> ExperimentConfig:
    """Reads a YAML experiment (or the defaults when ``path`` is None) and applies overrides."""
    source = str(path) if path else "<defaults>"
    data: dict = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"{p}: no such config file")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    data = apply_overrides(data, list(overrides))
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source + (" (with overrides)" if overrides else ""))) from None


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
