"""Which GPU each rank uses, and how many requests' KV cache an embedded engine can hold.

Pure functions of the config and the machine's GPU count / memory, so the launcher checks a
placement before any process starts, and tests check it with made-up device counts.

Ranks of a node are laid out as torchrun numbers them: global rank ``node * nproc + local``,
trainer ranks first (moe_rl.dist.Layout). ``placement.gpus`` maps each local rank to a GPU;
by default every rank gets its own GPU while there are enough, otherwise the node's trainer
ranks get one GPU each and its engine ranks fill the GPUs round-robin, starting after the
trainers' (one GPU: trainer and engine share GPU 0). Rules, each error naming its key:

- trainer ranks of a node need distinct GPUs (their gradients travel over NCCL);
- with ``sync.backend`` resolving to nccl, trainer rank 0 and the engine ranks of its node
  need distinct GPUs (NCCL cannot join two ranks on one device): colocated runs choose
  ``sync.backend=gloo`` (buckets staged through host memory) or ``ipc`` (the engine maps the
  trainer's CUDA bucket, moe_rl.sync.ipc) explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError


class PlacementError(ConfigError):
    """A placement that cannot run on this machine; the message names the config key."""


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda"
    gpus: tuple[int, ...] | None  # GPU of each global rank (cuda), None on CPU
    nproc_per_node: int
    sync_backend: str  # "nccl", "gloo" or "ipc": the weight-sync group's backend

    def gpu(self, rank: int) -> int | None:
        return None if self.gpus is None else self.gpus[rank]

    def shares_gpu(self, rank: int) -> bool:
        """Another rank of the same node uses this rank's GPU."""
        if self.gpus is None:
            return False
        node = rank // self.nproc_per_node
        return any(r != rank and r // self.nproc_per_node == node and g == self.gpus[rank]
                   for r, g in enumerate(self.gpus))


def sync_backend(cfg) -> str:
    if cfg.sync.backend != "auto":
        return cfg.sync.backend
    return "nccl" if cfg.train.device == "cuda" else "gloo"


def _auto_local_map(roles: list[str], num_gpus: int) -> list[int]:
    """One GPU per rank while there are enough; else trainers first, engines round-robin."""
    if num_gpus >= len(roles):
        return list(range(len(roles)))
    trainers = sum(r == "trainer" for r in roles)
    out, t, e = [], 0, 0
    for role in roles:
        if role == "trainer":
            out.append(t % num_gpus)  # more trainers than GPUs: refused below
            t += 1
        else:
            out.append((trainers + e) % num_gpus)
            e += 1
    return out


def resolve_placement(cfg, num_gpus: int) -> Placement:
    """The placement of every rank of ``cfg`` on nodes of ``num_gpus`` GPUs each; raises
    PlacementError naming the key to change."""
    from .dist import Layout

    layout = Layout.from_config(cfg)
    nproc = cfg.pools.nproc_per_node or layout.world_size
    backend = sync_backend(cfg)
    if backend == "ipc" and any(r // nproc != 0 for r in layout.rollout_ranks):
        raise PlacementError("sync.backend=ipc shares memory within one machine, but engine ranks run on other "
                             "nodes (pools.nproc_per_node); use sync.backend=nccl or gloo")
    if cfg.train.device != "cuda":
        if backend == "nccl":
            raise PlacementError("sync.backend=nccl needs train.device=cuda; use sync.backend=gloo (or auto) on CPU")
        return Placement("cpu", None, nproc, backend)
    if num_gpus < 1:
        raise PlacementError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    explicit = cfg.placement.gpus
    if explicit is not None:
        for i, g in enumerate(explicit):
            if not 0 <= g < num_gpus:
                raise PlacementError(f"placement.gpus[{i}]={g}: this node has {num_gpus} GPU(s) (0..{num_gpus - 1})")
    gpus: list[int] = []
    for start in range(0, layout.world_size, nproc):
        ranks = list(range(start, min(start + nproc, layout.world_size)))
        local = list(explicit) if explicit is not None else _auto_local_map([layout.role(r) for r in ranks], num_gpus)
        gpus.extend(local[: len(ranks)])
        key = "placement.gpus" if explicit is not None else "pools.trainer"
        trainer_gpus = [gpus[r] for r in ranks if layout.role(r) == "trainer"]
        if len(set(trainer_gpus)) < len(trainer_gpus):
            raise PlacementError(
                f"{key}: {len(trainer_gpus)} trainer ranks on a node with {num_gpus} GPU(s) would share a GPU "
                f"(GPUs {trainer_gpus}); each trainer rank needs its own GPU (NCCL)")
        engine_gpus = [gpus[r] for r in ranks if layout.role(r) == "rollout"]
        most = max((engine_gpus.count(g) for g in set(engine_gpus)), default=0)
        if most * cfg.placement.mem_fraction_static >= 1:
            raise PlacementError(
                f"placement.mem_fraction_static={cfg.placement.mem_fraction_static}: {most} engine ranks share a GPU "
                f"and would take {most * cfg.placement.mem_fraction_static:.2f} of its memory; lower it below "
                f"{1 / most:.2f} or spread the engines (placement.gpus)")
    placement = Placement("cuda", tuple(gpus), nproc, backend)
    if backend == "nccl":
        sync_ranks = [0] + [r for r in layout.rollout_ranks if r // nproc == 0]
        used = [gpus[r] for r in sync_ranks]
        if len(set(used)) < len(used):
            shared = sorted({g for g in used if used.count(g) > 1})
            raise PlacementError(
                f"sync.backend={cfg.sync.backend} uses NCCL, which cannot join two ranks on one GPU, but trainer "
                f"rank 0 and the engine ranks of its node share GPU(s) {shared}: set sync.backend=gloo (CPU-staged "
                f"weight sync) or ipc (CUDA IPC), or give them separate GPUs (placement.gpus)")
    return placement


# --- the embedded engine's KV cache --------------------------------------------------------
def kv_bytes_per_request(arch, max_context: int, element_size: int) -> int:
    """The decode state of every layer (K/V for softmax attention; what each layer's kind
    declares) for one request slot of ``max_context`` tokens."""
    from .model.attention import state_specs

    return sum(spec.bytes_per_slot(max_context, element_size) for spec in state_specs(arch))


def kv_cache_slots(arch, *, max_context: int, max_running_requests: int, element_size: int,
                   weight_bytes: int, gpu_bytes: int, mem_fraction: float) -> int:
    """Requests whose KV cache fits in ``mem_fraction`` of the GPU after the engine's weights
    (SGLang's --mem-fraction-static), at most ``max_running_requests``."""
    budget = int(mem_fraction * gpu_bytes) - weight_bytes
    per = kv_bytes_per_request(arch, max_context, element_size)
    slots = min(max_running_requests, budget // per if budget > 0 else 0)
    if slots < 1:
        raise PlacementError(
            f"placement.mem_fraction_static={mem_fraction}: {mem_fraction * gpu_bytes / 2**30:.2f} GiB of the "
            f"GPU's {gpu_bytes / 2**30:.2f} GiB leaves no room for one request's KV cache "
            f"({per / 2**20:.1f} MiB at engine.max_context={max_context}) after the engine's weights "
            f"({weight_bytes / 2**30:.2f} GiB); raise it or lower engine.max_context")
    return int(slots)


def engine_weight_bytes(cfg) -> int:
    """Bytes of the engine's weights (built on the meta device: no memory, no init)."""
    import torch

    from .model import MoEForCausalLM

    with torch.device("meta"):
        model = MoEForCausalLM(cfg.model.arch())
    size = torch.empty((), dtype=getattr(torch, cfg.engine.dtype)).element_size()
    return sum(p.numel() for p in model.parameters()) * size


def check_before_launch(cfg, num_gpus: int, gpu_bytes: int | None) -> Placement:
    """Everything the launcher can check on this node before starting a process."""
    placement = resolve_placement(cfg, num_gpus)
    if placement.device == "cuda" and cfg.engine.kind == "embedded" and cfg.pools.rollout and gpu_bytes:
        import torch

        arch = cfg.model.arch()
        kv_cache_slots(arch, max_context=min(cfg.engine.max_context, arch.max_position_embeddings),
                       max_running_requests=cfg.engine.max_running_requests,
                       element_size=torch.empty((), dtype=getattr(torch, cfg.engine.dtype)).element_size(),
                       weight_bytes=engine_weight_bytes(cfg), gpu_bytes=gpu_bytes,
                       mem_fraction=cfg.placement.mem_fraction_static)
    return placement
