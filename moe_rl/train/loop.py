"""The trainer: consumes rollout batches, trains with routing replay, syncs weights to engines.

Trainer rank 0 also runs the rollout manager (a thread with its own event loop) and owns the
buffer; each step's batch is broadcast to the other trainer ranks, which take their shard.
Per step:

  take B groups (staleness bound eta; DAPO dynamic sampling) -> advantages -> per rank: packed
  micro-batches with the engine's routing to replay -> log-probs (fused kernel) -> policy loss ->
  backward -> optimizer step (train.minibatches of them) -> version += 1 -> pause engines, bucketed
  weight sync, continue -> metrics, checkpoint.

With one optimizer update per batch (``train.minibatches: 1``) the proximal policy (the trainer
before its update) is the very forward that is being differentiated, so its log-probs are that
forward's, detached; with several, they are a no-grad forward taken before the first update.
Under ``true_on_policy`` with the embedded engine, a minibatch whose every trained token was
sampled by the weights the batch starts from needs no such forward: the engine's log-probs are
those bits already (docs/true_on_policy.md), so they are the proximal ones, the behaviour
weight (TIS, IcePop) is exactly 1, and the mismatch metrics are measured on the forwards taken.

Devices: a micro-batch (``Micro``) is packed on the host and brought to the backend's device
in one asynchronous copy per pass over it; the loss, the metrics and the routing match read
only that copy, and the step's metrics stay on the device until one read at its end
(docs/architecture.md, "Devices").

Routing replay (R3) and staleness: by default every sample's engine routing is replayed, stale
ones too (R3 as slime/MILES run it). ``replay.stale: trainer`` routes a stale sample (one made
by older weights) by the trainer itself, as the decoupled objective's proximal policy would
route it; ``replay_rows`` merges the two routings when a batch mixes fresh and stale samples.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.algo import compute_advantages, constant_groups, mismatch_metrics, overlong_penalty, policy_loss
from moe_rl.algo.token_loss import TokenLoss, fused_loss_unsupported
from moe_rl.config import ConfigError
from moe_rl.engine.client import EngineClient
from moe_rl.engine.host import exchange_urls
from moe_rl.engine.protocol import version_number
from moe_rl.liveness import describe, record_failure
from moe_rl.replay import ReplayLog, RoutingSpec, align_replay, filler_ids, packed_layout
from moe_rl.replay.match import routing_match
from moe_rl.rollout.buffer import RolloutBuffer
from moe_rl.rollout.evaluation import eval_metrics, eval_prompts, eval_requests, eval_task
from moe_rl.rollout.manager import RolloutManager
from moe_rl.sync.sender import WeightSender
from moe_rl.tasks import task_from_config

from .backend import MicroBatch
from .factory import build_backend
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .tracking import Tracker

log = logging.getLogger(__name__)


# --- groups -> batch -----------------------------------------------------------------------
def shaped_rewards(samples, cfg) -> torch.Tensor:
    """Task rewards plus DAPO's overlong penalty (zero while algo.overlong_buffer is 0)."""
    r = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    return r + overlong_penalty(lengths, cfg.rollout.max_new_tokens, cfg.algo)


def take_groups(cfg, buffer: RolloutBuffer, manager: RolloutManager, version: int, timeout: float | None = None):
    """(groups to train on, every group taken, dynamic-sampling metrics) for the step at ``version``.

    With rollout.dynamic_sampling (DAPO) a group whose shaped rewards are all equal has no
    advantage signal and is dropped; the manager may then submit as many more (``resample``:
    its staleness gate counts only groups trained on) and the step takes them, for at most
    rollout.max_sampling_rounds rounds. When they run out the step trains on the groups it has;
    if none has signal it trains on one (zero advantages) so that it always has one.
    The groups taken but not trained on are listed (``dyn_dropped_ids``): every prompt drawn is
    accounted for.
    """
    ro = cfg.rollout
    B, min_version = ro.prompts_per_step, version - ro.max_staleness
    if not ro.dynamic_sampling:
        groups = buffer.take(B, min_version, timeout, alive=manager.check)
        return groups, groups, {}
    kept, taken, rounds = [], [], 0
    while len(kept) < B and rounds < ro.max_sampling_rounds:
        need = B - len(kept)
        if rounds > 0:
            manager.resample(need)
        got = buffer.take(need, min_version, timeout, alive=manager.check)
        rounds += 1
        taken += got
        ok = [s for g in got for s in g.trainable]
        flat = set(constant_groups(shaped_rewards(ok, cfg), torch.tensor([s.group_id for s in ok])).tolist())
        kept += [g for g in got if g.trainable and g.group_id not in flat]
    shortfall = B - len(kept)
    kept = kept or taken[:1]
    dropped = [g.group_id for g in taken if g not in kept]
    dyn = dict(dyn_rounds=rounds, dyn_dropped_groups=len(dropped), dyn_dropped_ids=dropped, dyn_shortfall=shortfall)
    return kept, taken, dyn


# --- batch -> micro-batches ---------------------------------------------------------------
@dataclass
class Micro:
    """One micro-batch of a step: the backend's input and every per-token tensor the loss, the
    metrics and the routing match read. Built and kept on the host; ``to`` gives its copy on the
    backend's device, each tensor copied once per pass over the micro-batch (a proximal
    forward; the training forward and backward), so nothing in the step mixes devices and only
    the micro-batch in use occupies device memory.

    Per response token [R]: ``resp_pos`` (the packed row whose logits score it), ``behav``
    (the engine's log-prob), ``adv``, ``mask`` (1 where it is trained on), ``seq_ids`` (its
    sample in ``chunk``). Per packed row [T], with the replay log only: ``routing`` (the
    engine's, [moe_layers, T, top_k]), ``has_rec`` (the row has an engine record), ``stale``
    (its sample is routed by the trainer itself under ``replay.stale: trainer``). A rank with
    no samples gets a dummy (``chunk`` empty): expert parallelism needs every rank in every
    call. ``mb.replay`` is set on the device copy (``Trainer._on_device``)."""

    mb: MicroBatch
    chunk: list[dict]
    resp_pos: torch.Tensor | None = None
    behav: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None
    routing: torch.Tensor | None = None
    has_rec: torch.Tensor | None = None
    stale: torch.Tensor | None = None
    fresh: list[bool] = field(default_factory=list)  # per sample of chunk: its engine routing is replayed
    own: list[torch.Tensor] | None = None  # the trainer's routing for a mixed minibatch (on the device)

    @property
    def engine_routing(self) -> list[torch.Tensor] | None:
        """The engine's routing as the backends take it: one [T, top_k] per MoE layer (views)."""
        return None if self.routing is None else list(self.routing.unbind(0))

    def to(self, device: torch.device) -> "Micro":
        """Every tensor on ``device``, each copied once and asynchronously (from pinned memory
        on CUDA: a blocking host-to-device copy would wait for the whole stream)."""
        mb = self.mb
        replay = None if mb.replay is None else [_to_device(r, device) for r in mb.replay]
        moved = {f.name: _to_device(v, device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                 for f in fields(self)}
        moved["mb"] = MicroBatch(_to_device(mb.input_ids, device), _to_device(mb.cu_seqlens, device),
                                 _to_device(mb.labels, device), replay, mb.max_seqlen, mb.padding)
        return Micro(**moved)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


DUMMY_TOKENS = 2  # the packed row of a dummy micro-batch (a rank with no samples left)


def micro_batch_tokens(samples: list[dict], mbs: int, n_micro: int) -> list[int]:
    """The packed length of each micro-batch ``make_micro_batches`` makes from ``samples`` (unpadded)."""
    out = []
    for m in range(n_micro):
        chunk = samples[m * mbs : (m + 1) * mbs]
        out.append(sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in chunk) if chunk else DUMMY_TOKENS)
    return out


def shard_micro_batches(part: list[dict], rank: int, n_trainers: int, mbs: int, arch, replay_log,
                        equal_over: list[int] | None = None, bucket: int = 0) -> list[Micro]:
    """Trainer ``rank``'s shard of the minibatch ``part`` (every ``n_trainers``-th sample) packed
    into micro-batches; every rank gets the same number (expert parallelism needs every rank in
    every call). ``equal_over``: the trainer ranks whose micro-batch m must hold the same number
    of tokens (megatron's allgather dispatcher gathers equal-sized blocks over its EP group);
    each rank's micro-batch m is then padded to the longest of theirs, which every rank computes
    from ``part`` alone, without communication. ``bucket``: every micro-batch's length is then
    rounded up to a multiple of it (``train.token_bucket``: few distinct lengths, each a graph
    that ``train.cuda_graphs`` records once)."""
    shard = part[rank::n_trainers]
    n_micro = max(1, math.ceil(math.ceil(len(part) / n_trainers) / mbs))
    pad_to = None
    if equal_over is not None and len(equal_over) > 1:
        pad_to = [max(t) for t in zip(*(micro_batch_tokens(part[r::n_trainers], mbs, n_micro) for r in equal_over))]
    if bucket:
        pad_to = [-(-t // bucket) * bucket for t in (pad_to or micro_batch_tokens(shard, mbs, n_micro))]
    return make_micro_batches(shard, mbs, n_micro, arch, replay_log, pad_to)


def make_micro_batches(samples: list[dict], mbs: int, n_micro: int, arch, replay_log,
                       pad_to: list[int] | None = None) -> list[Micro]:
    """Packs ``samples`` (this rank's shard) into exactly ``n_micro`` micro-batches, on the
    host; a rank with fewer samples gets dummy ones. ``pad_to``: micro-batch m's packed row is
    filled up to ``pad_to[m]`` tokens with one filler sequence of token 0 (its own
    ``cu_seqlens`` segment, so no real sequence attends to it; no label, no response token,
    no engine routing: the loss and the metrics never see it; ``MicroBatch.padding`` keeps it out
    of the experts' load)."""
    out = []
    for m in range(n_micro):
        chunk = samples[m * mbs : (m + 1) * mbs]
        seqs = [s["prompt_ids"] + s["response_ids"] for s in chunk]
        lengths = [len(x) for x in seqs]
        total = sum(lengths) if chunk else DUMMY_TOKENS
        pad = 0 if pad_to is None else pad_to[m] - total
        if pad < 0:
            raise ValueError(f"make_micro_batches: micro-batch {m} holds {total} tokens, more than pad_to={pad_to[m]}")
        if not chunk:
            T = total + pad
            out.append(Micro(MicroBatch(torch.zeros(1, T, dtype=torch.long), torch.tensor([0, T]),
                                        torch.full((T,), -100, dtype=torch.long), padding=T), []))
            continue
        cu = np.concatenate([[0], np.cumsum(lengths + ([pad] if pad else []))])
        ids = torch.tensor([t for x in seqs for t in x] + [0] * pad, dtype=torch.long)
        labels = torch.full((int(cu[-1]),), -100, dtype=torch.long)
        resp_pos = []  # positions whose logits score each response token
        for s, start in zip(chunk, cu[:-1]):
            P, R = len(s["prompt_ids"]), len(s["response_ids"])
            pos = torch.arange(start + P - 1, start + P - 1 + R)
            labels[pos] = torch.tensor(s["response_ids"], dtype=torch.long)
            resp_pos.append(pos)
        routing, has_rec = None, None
        if replay_log is not None:
            k, E = arch.num_experts_per_tok, arch.num_experts
            L = len(arch.moe_layers)
            records = []
            has_rec = torch.zeros(int(cu[-1]), dtype=torch.bool)
            for s, n, start in zip(chunk, lengths, cu[:-1]):
                if s["has_routing"]:
                    records.append(replay_log.get(s["uid"]))
                    has_rec[start : start + n - 1] = True
                else:
                    records.append(np.broadcast_to(filler_ids(n - 1, k, E)[:, None, :], (n - 1, L, k)).copy())
            # the padding's rows (past the last sample) get align_replay's filler ids
            layout = replace(packed_layout(lengths), total=int(cu[-1]))
            routing = align_replay(records, layout, num_experts=E, stacked=True)
        out.append(Micro(
            MicroBatch(ids[None], torch.tensor(cu, dtype=torch.long), labels, padding=pad), chunk, torch.cat(resp_pos),
            behav=torch.tensor([x for s in chunk for x in s["behaviour_logprobs"]], dtype=torch.float32),
            adv=torch.tensor([s["advantage"] for s in chunk for _ in s["response_ids"]], dtype=torch.float32),
            mask=torch.tensor([m for s in chunk for m in _loss_mask(s)], dtype=torch.float32),
            seq_ids=torch.tensor([i for i, s in enumerate(chunk) for _ in s["response_ids"]], dtype=torch.long),
            routing=routing, has_rec=has_rec,
        ))
    return out


# --- the trainer ----------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg, groups):
        self.cfg, self.groups = cfg, groups
        self.rank = groups.rank
        self.lead = groups.rank == 0
        self.n_trainers = len(groups.layout.trainer_ranks)
        torch.manual_seed(cfg.train.seed)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.run_dir = Path(cfg.output_dir)
        self.backend = build_backend(cfg, groups)
        self._rollout_mark = (0, 0.0)  # (generated tokens, wall s) at the last logged step
        self.arch = self.backend.arch
        self.ref = build_backend(cfg, groups) if cfg.algo.kl_coef > 0 else None  # frozen initial policy
        self.fused_loss = use_fused_loss(cfg, log if self.lead else None)
        # the engine's log-probs are the trainer's bits at staleness 0 (a proximal forward is skipped)
        self.exact_rollouts = cfg.true_on_policy and cfg.engine.kind == "embedded"
        self.task = task_from_config(cfg)
        self.record_routing = cfg.replay.enabled or cfg.engine.kind == "embedded"
        self.replay_dir = Path(cfg.replay.dir or self.run_dir / "routing")
        self.step, self.version = 0, 0
        self.manager: RolloutManager | None = None
        self.buffer = RolloutBuffer()
        self.reader: ReplayLog | None = None
        self.writer: ReplayLog | None = None

    # --- set-up ---------------------------------------------------------------------------
    def _engine_urls(self) -> list[str]:
        urls = exchange_urls(None, self.cfg.dist.timeout_s)  # collective with the engine ranks (moe_rl.dist)
        urls = urls + list(self.cfg.engine.urls)
        if not urls:
            raise RuntimeError("no rollout engines: pools.rollout=0 and engine.urls is empty")
        return urls

    def setup(self):
        cfg = self.cfg
        self.urls = self._engine_urls()
        resume_state, rollout_state = {}, None
        if cfg.resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise FileNotFoundError(f"resume=true but {self.run_dir}/checkpoints has no checkpoint")
            resume_state, rollout_state = load_checkpoint(ckpt, self.backend, self.rank)
            self.step, self.version = resume_state["step"], resume_state["version"]
            log.info("resumed from %s at step %d", ckpt, self.step)
        elif self.lead and (self.run_dir / "checkpoints").exists():
            log.warning("%s already holds checkpoints; starting afresh (resume=true continues)", self.run_dir)
        # an embedded engine in another precision (bf16 engine, fp32 trainer) is sent its own dtype
        wire = getattr(torch, cfg.engine.dtype) if cfg.engine.kind == "embedded" else None
        if cfg.engine.kind == "sglang" and cfg.lora.enabled and cfg.lora.sync == "adapter":
            from moe_rl.sync.adapter_files import AdapterFileSync  # SGLang's LoRA endpoints (docs/lora.md)

            self.sender = AdapterFileSync(self.backend.lora, self.urls, self.run_dir / "lora_sync", is_source=self.lead,
                                          api_key=cfg.engine.api_key, timeout_s=cfg.sync.timeout_s)
        else:
            self.sender = WeightSender.from_config(self.backend.hf_source(), cfg.sync, self.groups,
                                                  engines=self.urls if self.lead else (), wire_dtype=wire,
                                                  dense_params=self.backend.needs_dense_params)
        if self.record_routing:
            if self.lead:  # a fresh start's log is empty: moe_rl.rundir refused or deleted an old one
                self.writer = ReplayLog(self.replay_dir, len(self.arch.moe_layers), self.arch.num_experts_per_tok,
                                        self.arch.num_experts)
            self._trainer_barrier()
            self.reader = ReplayLog(self.replay_dir, mode="r")
        if self.version > 0:  # a resumed run: engines start from the initial weights
            self.sender.sync(str(self.version))
        if self.lead:
            client = EngineClient.from_config(cfg.engine, self.urls)
            client.lora_path = getattr(self.sender, "lora_name", None)
            spec = RoutingSpec(self.arch.num_hidden_layers, self.arch.num_experts_per_tok, self.arch.num_experts,
                               tuple(self.arch.mlp_only_layers), self.arch.decoder_sparse_step,
                               self.arch.first_k_dense_replace)
            m = rollout_state or {}
            if m:
                self.buffer.load_state_dict(m["buffer"])
                if self.writer is not None:  # the checkpoint resumed from: its buffer's records stay
                    self.writer.set_pinned(self.step, _buffer_uids(m))
            self.manager = RolloutManager(
                cfg, self.task, client, self.buffer, self.writer, spec,
                start_index=m.get("next_index", 0), pending=m.get("pending"), version=self.version,
                submitted=m.get("submitted", 0),
                attempt=RolloutManager.next_attempt(m.get("attempt", -1), self.writer),
            )
            self.tracker = Tracker.from_config(cfg, start_step=self.step)
            if cfg.eval.every:  # the held-out prompts and their requests, the same at every evaluation
                task = eval_task(cfg)
                prompts = eval_prompts(cfg, task)
                self._eval_plan = (task, prompts, eval_requests(cfg, task, prompts))

    def _trainer_barrier(self):
        if self.n_trainers > 1:
            dist.barrier(group=self.groups.trainer_wait)

    def _note(self, where: str) -> None:
        """Where this rank is: the heartbeat carries it, and a watcher names it if this rank freezes."""
        if self.groups.liveness is not None:
            self.groups.liveness.set_note(where)

    # --- one step -------------------------------------------------------------------------
    def _take_batch(self) -> tuple[list[dict], dict]:
        """Rank 0 takes B groups and computes advantages; every trainer rank gets the batch."""
        obj = [None]
        if self.lead:
            t0 = time.perf_counter()
            groups, sampled, dyn = take_groups(self.cfg, self.buffer, self.manager, self.version)
            wait_s = time.perf_counter() - t0
            samples = [s for g in sampled for s in g.samples]  # rewards are reported over all sampled
            ok = [s for g in groups for s in g.trainable]
            adv, constant = torch.zeros(0), 0
            if ok:
                rewards, gids = shaped_rewards(ok, self.cfg), torch.tensor([s.group_id for s in ok])
                adv = compute_advantages(rewards, gids, self.cfg.algo)
                # groups trained on whose rewards are all equal: zero advantages, no policy-gradient
                # signal (all of them once a policy turns deterministic on a one-answer task)
                constant = len(constant_groups(rewards, gids))
            batch = [dict(uid=s.uid, group_id=s.group_id, prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                          behaviour_logprobs=s.behaviour_logprobs, versions=s.versions, advantage=float(a),
                          has_routing=s.has_routing, loss_mask=s.loss_mask) for s, a in zip(ok, adv.tolist())]
            info = dict(
                wait_s=wait_s, groups=[g.group_id for g in groups], rewards=[s.reward for s in samples],
                failed=sum(s.failed is not None for s in samples), lengths=[len(s.response_ids) for s in samples],
                resumes=sum(s.resumes for s in samples),
                staleness=[self.version - v for s in ok for v in s.model_versions], **dyn,
                turns=[s.turns for s in samples], constant_reward_groups=constant,
                reward_metrics=[s.metrics for s in samples if s.failed is None],
            )
            obj = [(batch, info)]
        if self.n_trainers > 1:  # on the wait group: the other ranks wait here while rank 0 waits for rollouts
            dist.broadcast_object_list(obj, group=self.groups.trainer_wait, group_src=0)
        return obj[0]

    def train_step(self, batch: list[dict]) -> dict:
        """``train.minibatches`` optimizer updates on ``batch`` (one by default). Every
        minibatch is packed and routed, and its proximal log-probs taken, with the weights the
        batch started from: the decoupled objective's proximal policy, so the clip acts from
        the second update on (with ``algo.ratio_anchor: behaviour`` the clip is against the
        engine's log-probs, and no proximal forward is taken)."""
        cfg = self.cfg
        n_mini = min(cfg.train.minibatches, max(len(batch), 1))
        if self.reader is not None:
            self.reader.refresh()
        parts = [batch[len(batch) * j // n_mini : len(batch) * (j + 1) // n_mini] for j in range(n_mini)]
        prepared = [self._prepare(part) for part in parts]
        # coupled PPO (ratio_anchor=behaviour) never reads the proximal log-probs: no extra forward;
        # nor does an exactly on-policy minibatch (true_on_policy): its behaviour log-probs are they
        coupled = cfg.algo.ratio_anchor == "behaviour"
        skip = [not coupled and j > 0 and p["exact_on_policy"] for j, p in enumerate(prepared)]
        proximal = [None] * n_mini if coupled else [None] + [self._behaviour(p) if s else self._proximal(p)
                                                             for p, s in zip(prepared[1:], skip[1:])]
        # loss, k3*n, n, match, total, entropy*n, clip*n, ice*n, stale match, stale total, tokens the
        # mismatch is measured on: on the backend's device, read once at the end of the step
        dev = self.backend.device
        sums = torch.zeros(11, dtype=torch.float64, device=dev)
        max_ratio = torch.zeros(1, dtype=torch.float64, device=dev)
        steps = []
        for prep, prox, s in zip(prepared, proximal, skip):
            self._accumulate(prep, prox, sums, max_ratio, measured=not s)
            steps.append(self.backend.optimizer_step())
        T = self.n_trainers
        if T > 1:
            dist.all_reduce(sums, group=self.groups.trainer)
            dist.all_reduce(max_ratio, op=dist.ReduceOp.MAX, group=self.groups.trainer)
        # the optimizer's statistics (grad_norm per update) join them: the step's one read
        keys = list(steps[0])
        stats = [torch.as_tensor(s[k], dtype=torch.float64, device=dev).reshape(1) for s in steps for k in keys]
        values = torch.cat([sums, max_ratio, *stats]).tolist()
        tot, max_ratio, stats = values[:11], values[11], values[12:]
        n = max(tot[2], 1.0)
        out = {
            "loss": tot[0] / n_mini,  # each minibatch's loss is normalised on its own
            "mismatch_k3": tot[1] / max(tot[10], 1.0),
            "mismatch_max_ratio": max_ratio,
            "clip_frac": tot[6] / n,
            "icepop_frac": tot[7] / n,
            "train_tokens": int(tot[2]),
            **({"entropy": tot[5] / n} if cfg.algo.entropy_coef > 0 else {}),
            **{k: float(np.mean(stats[i :: len(keys)])) for i, k in enumerate(keys)},
        }
        if tot[4] > 0:  # R3: where the engine's routing was replayed
            out["routing_match"] = tot[3] / tot[4]
        if tot[9] > 0:  # stale samples: the older router's experts vs the trainer's own
            out["routing_match_stale"] = tot[8] / tot[9]
        if cfg.true_on_policy:
            out["proximal_forwards_skipped"] = sum(skip)
        return out

    def _prepare(self, part: list[dict]) -> dict:
        """One minibatch: this rank's shard packed into micro-batches (on the host), each with
        what decides the routing it replays (module docstring), resolved with the current
        weights."""
        cfg = self.cfg
        mbs, T = cfg.train.micro_batch_size, self.n_trainers
        equal_over = self.groups.layout.ep_groups[self.rank // self.backend.ep_size] \
            if self.backend.equal_tokens_per_ep_rank else None
        micro = shard_micro_batches(part, self.rank, T, mbs, self.arch, self.reader, equal_over,
                                    self.cfg.train.micro_batch_bucket)
        # which samples' engine routing is replayed: decided on the whole minibatch, so every
        # rank makes the same number of forward calls (expert parallelism)
        fresh = [cfg.replay.stale == "engine" or all(v == self.version for v, m in zip(s["versions"], _loss_mask(s)) if m)
                 for s in part]
        mixed = cfg.replay.enabled and any(fresh) and not all(fresh)
        fresh_shard = fresh[self.rank :: T] if T > 1 else fresh
        algo = cfg.algo
        if algo.loss_agg == "token_sum_norm" and algo.loss_norm_tokens is None:
            algo = algo.model_copy(update={"loss_norm_tokens": cfg.rollout.max_new_tokens * max(len(part), 1)})
        for m_i, mc in enumerate(micro):
            mc.fresh = fresh_shard[m_i * mbs : m_i * mbs + len(mc.chunk)]
            if mc.routing is not None:
                mc.stale = stale_rows(mc.fresh, mc.mb.cu_seqlens)
            if mixed:  # the trainer's own routing for the stale samples' rows (every rank, every call)
                mc.own = []
                with torch.no_grad():
                    self.backend.logprobs(mc.mb, cfg.rollout.temperature, record=mc.own)
        # every trained token sampled by these very weights, by the exact engine: its log-probs are ours
        exact_on_policy = self.exact_rollouts and all(v == self.version for s in part
                                                      for v, m in zip(s["versions"], _loss_mask(s)) if m)
        return dict(micro=micro, algo=algo, n_tok=sum(sum(_loss_mask(s)) for s in part),
                    n_seq=sum(1 for s in part if s["response_ids"]), exact_on_policy=exact_on_policy)

    def _on_device(self, mc: Micro) -> Micro:
        """``mc`` on the backend's device (one asynchronous copy of each tensor), with the
        routing its forward replays: the engine's for fresh samples, the trainer's own for
        stale ones under ``replay.stale: trainer``, none (the router chooses) without replay."""
        d = mc.to(self.backend.device)
        if self.cfg.replay.enabled and d.routing is not None and d.chunk:
            d.mb.replay = replay_rows(d.engine_routing, d.own, d.fresh, d.stale)
        return d

    def _behaviour(self, prep: dict) -> list[torch.Tensor | None]:
        """The engine's log-probs of a minibatch's response tokens as its proximal ones (an exactly
        on-policy minibatch under true_on_policy: the same bits a proximal forward would give)."""
        return [_to_device(mc.behav, self.backend.device) if mc.chunk else None for mc in prep["micro"]]

    @torch.no_grad()
    def _proximal(self, prep: dict) -> list[torch.Tensor | None]:
        """The proximal log-probs of a minibatch's response tokens, one per micro-batch."""
        out = []
        for mc in prep["micro"]:
            d = self._on_device(mc)
            logp_all = self.backend.logprobs(d.mb, self.cfg.rollout.temperature)[0]  # every rank, every call
            out.append(logp_all[d.resp_pos] if d.chunk else None)
        return out

    def _accumulate(self, prep: dict, proximal: list | None, sums: torch.Tensor, max_ratio: torch.Tensor,
                    measured: bool = True) -> None:
        """Forward and backward of one minibatch's micro-batches (gradients accumulate), adding
        its metrics to ``sums`` (on the device: no host read here). ``proximal`` None: the
        proximal policy is this very forward. ``measured`` False: the proximal log-probs are the
        behaviour ones (no forward took them), which the mismatch metrics leave out."""
        cfg = self.cfg
        temp = cfg.rollout.temperature
        need_entropy = cfg.algo.entropy_coef > 0
        for m_i, mc in enumerate(prep["micro"]):
            d = self._on_device(mc)
            used = [] if d.routing is not None else None
            if not d.chunk:
                # a dummy runs the forwards a real micro-batch runs, in its order (the frozen policy's
                # first on the fused path), and a backward: every EP rank meets the same collectives
                if self.fused_loss:
                    self._ref_logp(d)
                logp_all, _ = self.backend.logprobs(d.mb, temp, record=used)
                if not self.fused_loss:
                    self._ref_logp(d)
                (logp_all.sum() * 0.0).backward()
                continue
            if self.fused_loss:
                loss, m, prox = self._fused_step(prep, d, None if proximal is None else proximal[m_i], used)
            else:
                logp_all, ent_all = self.backend.logprobs(d.mb, temp, with_entropy=need_entropy, record=used)
                logp = logp_all[d.resp_pos]
                prox = logp.detach() if proximal is None else proximal[m_i]
                ref_logp = self._ref_logp(d)
                loss, m = policy_loss(
                    logp, prox, d.behav, d.adv, d.mask, d.seq_ids, prep["algo"], ref_logp=ref_logp,
                    entropy=None if ent_all is None else ent_all[d.resp_pos],
                    num_tokens_global=prep["n_tok"], num_seqs_global=prep["n_seq"],
                )
                loss.backward()
            mm = mismatch_metrics(prox, d.behav, d.mask)  # the weights that sampled vs those the batch started from
            n = mm["num_tokens"]
            sums[0] += loss.detach()
            sums[2] += n
            if measured:
                sums[1] += mm["mismatch_k3"] * n
                sums[10] += n
                max_ratio.clamp_(min=mm["mismatch_max_ratio"])
            if used is not None:
                # replayed rows (fresh samples) vs rows the trainer routed itself (stale ones)
                replayed = d.has_rec & ~d.stale if cfg.replay.enabled else d.has_rec
                engine = d.engine_routing
                a, b = routing_match(used, engine, replayed)
                sums[3] += a
                sums[4] += b
                a, b = routing_match(used, engine, d.has_rec & ~replayed)
                sums[8] += a
                sums[9] += b
            if need_entropy:
                sums[5] += m["entropy"] * n
            sums[6] += m["clip_frac"] * n
            sums[7] += m["icepop_frac"] * n

    @torch.no_grad()
    def _ref_logp(self, d: Micro) -> torch.Tensor | None:
        """The frozen initial policy's log-probs of ``d``'s response tokens (the KL term); None without
        one, or for a dummy ``d`` (whose forward still runs: expert parallelism needs every rank)."""
        if self.ref is None:
            return None
        logp = self.ref.logprobs(d.mb, self.cfg.rollout.temperature)[0]
        return logp[d.resp_pos] if d.chunk else None

    def _fused_step(self, prep: dict, d: Micro, proximal: torch.Tensor | None, used: list | None):
        """One micro-batch's policy loss fused into the LM head (``train.fused_loss``): its
        d_hidden and d_weight come out of the forward (moe_rl.kernels.fused_token_loss), then
        backward runs the rest of the model. The metrics are policy_loss's (no grad) on the
        log-probs the op returns, as on the general path. Returns (loss, metrics, proximal)."""
        temp, algo = self.cfg.rollout.temperature, prep["algo"]
        ref_logp = self._ref_logp(d)  # the KL term's per-token constant: before the policy's forward
        token_loss = TokenLoss(algo, d.behav, d.adv, d.mask, d.seq_ids, proximal_logp=proximal, ref_logp=ref_logp,
                               num_tokens_global=prep["n_tok"], num_seqs_global=prep["n_seq"])
        loss, logp, ent = self.backend.token_loss(d.mb, d.resp_pos, temp, token_loss,
                                                  with_entropy=algo.entropy_coef > 0, record=used)
        prox = logp if proximal is None else proximal
        with torch.no_grad():
            _, m = policy_loss(logp, prox, d.behav, d.adv, d.mask, d.seq_ids, algo, ref_logp=ref_logp, entropy=ent,
                               num_tokens_global=prep["n_tok"], num_seqs_global=prep["n_seq"])
        loss.backward()
        return loss, m, prox

    # --- the run --------------------------------------------------------------------------
    def run(self):
        cfg = self.cfg
        self.setup()
        if self.lead:
            self.manager.start()
        t_start = time.monotonic()
        busy = 0.0
        try:
            while self.step < cfg.train.steps:
                self._note(f"step {self.step + 1}")
                batch, info = self._take_batch()
                t0 = time.perf_counter()
                metrics = self.train_step(batch)
                train_s = time.perf_counter() - t0
                self.version += 1
                if self.lead:
                    self.manager.begin_update()
                t1 = time.perf_counter()
                try:
                    sync = self.sender.sync(str(self.version))
                    if self.lead:  # engines the sync could not reach serve no rollouts until one does
                        self.manager.client.set_stale(sync.skipped)
                        self.manager.client.lora_path = getattr(self.sender, "lora_name", None)
                finally:
                    if self.lead:
                        self.manager.end_update(self.version)
                sync_s = time.perf_counter() - t1
                busy += train_s + sync_s
                self.step += 1
                if self.lead:
                    self._log(info, metrics, train_s, sync_s, sync, busy, t_start, self._evaluate())
                every = cfg.checkpoint.every
                if (every and self.step % every == 0) or self.step == cfg.train.steps:
                    self._checkpoint()
                if self.lead and self.writer is not None and cfg.replay.retention:
                    self._drop_routing()
        except Exception as e:
            e.add_note(f"the run stopped at step {self.step + 1} of {cfg.train.steps}; resume=true continues from "
                       f"the latest checkpoint")
            raise
        finally:
            if self.lead:
                self.manager.stop()
                self.tracker.close()
            self.sender.close()

    # --- evaluation between steps (moe_rl/rollout/evaluation.py) ----------------------------
    def _evaluate(self) -> dict:
        """The ``eval/*`` metrics of the weights the engines now serve (version = step), every
        ``eval.every`` steps and after the last step; {} at other steps. Rollouts go on beside it."""
        every, last = self.cfg.eval.every, self.step == self.cfg.train.steps
        if not every or (self.step % every and not last):
            return {}
        t0 = time.perf_counter()
        task, prompts, requests = self._eval_plan
        results = self.manager.evaluate(task, prompts, requests)
        served = {version_number(v) for per_prompt in results for *_, v in per_prompt}
        if served != {self.version}:
            raise RuntimeError(f"evaluation at step {self.step}: served by weight versions {sorted(served)}, "
                               f"expected only {self.version}")
        rewards, failed, lengths = (np.array([[r[i] for r in per_prompt] for per_prompt in results]) for i in range(3))
        out = eval_metrics(rewards.astype(float), lengths, failed, self.cfg.eval.pass_threshold)
        out["eval/time_s"] = time.perf_counter() - t0
        return out

    def _log(self, info, metrics, train_s, sync_s, sync, busy, t_start, evaluation: dict):
        rewards = info["rewards"]
        wall = time.monotonic() - t_start
        st = np.asarray(info["staleness"] or [0])
        row = {
            "version": self.version,
            "reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "reward_std": float(np.std(rewards)) if rewards else float("nan"),
            "response_len_mean": float(np.mean(info["lengths"])) if info["lengths"] else 0.0,
            "response_len_max": int(max(info["lengths"] or [0])),
            "samples": len(rewards),
            "failed_samples": info["failed"],
            "resumed_requests": info["resumes"],
            **({"turns_mean": float(np.mean(info["turns"])),
                "env_failures": self.manager.stats["env_failures"]} if self.cfg.env.factory else {}),
            **_mean_metrics(info.get("reward_metrics") or []),
            "staleness_mean": float(st.mean()),
            "staleness_max": int(st.max()),
            **{f"staleness_hist_{k}": int((st == k).sum()) for k in range(int(st.max()) + 1)},
            **metrics,
            "tokens_per_s": metrics["train_tokens"] / max(train_s, 1e-9),
            "train_s": train_s,
            "wait_s": info["wait_s"],
            "sync_s": sync_s,
            "sync_gbps": sync.gbps if sync is not None else 0.0,
            "busy_trainer": busy / max(wall, 1e-9),
            "busy_rollout": self.manager.busy_fraction_since(t_start),
            "dropped_stale_groups": self.buffer.dropped_stale,
            "engine_failures": self.manager.stats["engine_failures"],  # resubmitted requests, cumulative
            "engines_skipped": len(sync.skipped) if sync is not None else 0,  # down at this sync
            "groups": info["groups"],
            "constant_reward_groups": info["constant_reward_groups"],
            **{k: v for k, v in info.items() if k.startswith("dyn_")},
            "wall_s": wall,
            **evaluation,
        }
        gen = self.manager.stats["generated_tokens"]  # every token the engines returned, kept or not
        prev_gen, prev_wall = self._rollout_mark
        self._rollout_mark = (gen, wall)
        row["rollout_tokens_per_s"] = (gen - prev_gen) / max(wall - prev_wall, 1e-9)
        self.tracker.log(self.step, row, histograms={"staleness": st})

    def _checkpoint(self):
        rollout_state = None
        if self.lead:
            rollout_state = self.manager.state_dict()
            if self.writer is not None:
                self.writer.flush()
        save_checkpoint(self.run_dir, self.step, self.backend, self.groups,
                        {"step": self.step, "version": self.version}, rollout_state, self.cfg.checkpoint.keep)
        if self.lead and self.writer is not None:  # durable now: a resume starts from it
            self.writer.set_pinned(self.step, _buffer_uids(rollout_state))

    def _drop_routing(self) -> None:
        """Rank 0, after a step: the routing log starts a new generation and deletes the older
        ones that hold no record still in use (the step's batch is trained on: the other ranks
        read their records before its gradient all-reduce). Records the latest checkpoint's
        buffer needs are kept (moe_rl/replay/log.py)."""
        self.writer.roll()
        self.writer.drop_unused(self.manager.live_uids())


def replay_rows(engine: list[torch.Tensor], own: list[torch.Tensor] | None, fresh: list[bool],
                stale: torch.Tensor) -> list[torch.Tensor] | None:
    """The routing a micro-batch replays: the engine's rows for the sequences in ``fresh``
    (produced by the trainer's current weights), ``own`` (the trainer's routing, one [T, k]
    tensor per MoE layer) for the others, whose rows ``stale`` marks ([T] bool, from
    ``stale_rows``; every tensor on one device). None (the router chooses) when no sequence is
    fresh."""
    if not any(fresh):
        return None
    if all(fresh):
        return engine
    if own is None:
        raise ValueError("replay_rows: a micro-batch mixing fresh and stale sequences needs the trainer's own routing")
    return [torch.where(stale[:, None], o.to(e.dtype), e) for e, o in zip(engine, own)]


def stale_rows(fresh: list[bool], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] bool: the packed rows of the sequences not in ``fresh`` (rows past them: True).
    ``cu_seqlens`` on the host (the loop calls it before the micro-batch goes to the device)."""
    lengths = torch.diff(cu_seqlens)
    stale = torch.repeat_interleave(~torch.tensor(fresh, dtype=torch.bool), lengths[: len(fresh)])
    return torch.cat([stale, torch.ones(int(cu_seqlens[-1]) - stale.numel(), dtype=torch.bool)])


def _buffer_uids(rollout_state: dict) -> set[str]:
    """The samples in a checkpoint's rollout buffer: a resume from it trains on them."""
    return {s["uid"] for g in rollout_state["buffer"]["groups"] for s in g["samples"]}


def _loss_mask(s: dict) -> list[int]:
    """1 on the tokens trained on: all response tokens, or the model's tokens of an episode."""
    m = s.get("loss_mask")
    return [1] * len(s["response_ids"]) if m is None else m


def _mean_metrics(rows: list[dict]) -> dict:
    """Batch means of a reward.fn plug-in's extra metrics, as ``reward/<name>``."""
    keys = sorted({k for r in rows for k in r})
    return {f"reward/{k}": float(np.mean([r[k] for r in rows if k in r])) for k in keys}


def use_fused_loss(cfg, logger=None) -> bool:
    """Whether the policy loss runs fused into the LM head (``train.fused_loss``; the choice
    is logged once through ``logger``): ``auto`` when algo's loss is per-token, ``true``
    refuses one that is not, ``false`` never."""
    mode = cfg.train.fused_loss
    why = fused_loss_unsupported(cfg.algo)
    if mode is True and why:
        raise ConfigError(f"train.fused_loss=true: {why}; set train.fused_loss to auto or false")
    fused = mode is not False and why is None
    if logger is not None:
        if fused and cfg.true_on_policy:
            logger.info("policy loss per token on the LM head's exact log-probs (train.fused_loss=%s; true_on_policy: "
                        "the fused LM-head kernel sums in another order, so the exact linear and log-softmax take "
                        "its place and the backward runs through them)", str(mode).lower())
        elif fused:
            logger.info("policy loss fused into the LM head (train.fused_loss=%s, algo.policy_loss=%s, "
                        "algo.loss_agg=%s): d_hidden and d_weight come out of its forward", str(mode).lower(),
                        cfg.algo.policy_loss, cfg.algo.loss_agg)
        else:
            logger.info("policy loss on the general path (log-probs, then policy_loss, then backward): %s",
                        "train.fused_loss=false" if mode is False else f"train.fused_loss=auto but {why}")
    return fused


def run_trainer(cfg, groups) -> None:
    trainer = Trainer(cfg, groups)
    completed = False
    try:
        trainer.run()
        completed = True
    except Exception as e:  # recorded first: a frozen engine killed below ends the world at once
        record_failure(describe(e))
        raise
    finally:  # releases the engine ranks, however the run ended (moe_rl.liveness)
        groups.liveness.trainer_done()
        if trainer.lead:
            groups.liveness.release_engines(completed)
    if trainer.lead:
        log.info("done: %d steps; metrics in %s", trainer.step, Path(cfg.output_dir) / "metrics.jsonl")
