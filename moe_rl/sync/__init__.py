"""Weight sync from the trainer pool to the rollout engines (SGLang's distributed update).

- ``plan``: buckets of at most ``sync.bucket_mb`` over the HF tensor list, one dtype each;
- ``group``: the weight-sync process group (TCPStore + gloo/NCCL), used by both sides;
- ``sender``: ``WeightSender`` (trainer pool): EP gather per bucket, pack, broadcast, with
  pause -> update -> continue around it (``sync`` / ``sync_async``);
- ``receiver``: ``WeightReceiver`` (engine side): receive, verify, stage, atomic commit;
- ``engines``: the engine calls behind one async interface (``moe_rl.engine.client``);
- ``local``: a receiver in another process over a pipe (tests, benchmark).
"""
from .engines import EngineAPI, EngineCallError, as_engine
from .group import SyncGroup, free_port
from .plan import Bucket, Plan, checksum, dtype_name, model_specs, parse_dtype, plan_buckets, verify_checksum
from .receiver import WeightReceiver, WeightSyncError
from .sender import SyncStats, WeightSender

__all__ = [
    "Bucket", "Plan", "plan_buckets", "model_specs", "checksum", "verify_checksum", "dtype_name", "parse_dtype",
    "SyncGroup", "free_port", "WeightReceiver", "WeightSyncError", "WeightSender", "SyncStats",
    "EngineAPI", "EngineCallError", "as_engine",
]
