"""The unit of data between rollout and training (DESIGN.md contract 5)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Sample:
    uid: str  # also the key of its routing record in the replay log
    group_id: int  # GRPO group = prompt index in the task's stream
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # fp32, one per response token, from the engine
    versions: list[int]  # policy version that produced each response token
    reward: float = 0.0
    finish_reason: str = "length"
    failed: str | None = None  # why the sample cannot be trained on (reward raised, ...)
    has_routing: bool = False  # a record for uid is in the replay log
    resumes: int = 0  # times it was resubmitted with its prefix after a weight update
    metrics: dict[str, float] = field(default_factory=dict)  # extra metrics of a reward.fn plug-in
    # multi-turn episodes (moe_rl/rollout/episode.py): response_ids hold the model's and the
    # environment's tokens in order; loss_mask is 1 on the model's, 0 on the environment's (None:
    # all model tokens). behaviour_logprobs/versions of environment tokens are placeholders
    # (0.0 / the version of the model token before them) and never trained on.
    loss_mask: list[int] | None = None
    turns: int = 1
    turn_rewards: list[float] | None = None

    @property
    def model_versions(self) -> list[int]:
        """The versions of the model's tokens (all response tokens of a single-turn sample)."""
        if self.loss_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def min_version(self) -> int:
        v = self.model_versions
        return min(v) if v else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        return cls(**d)


@dataclass
class Group:
    """The n samples of one prompt; advantages are computed inside a group."""

    group_id: int
    samples: list[Sample] = field(default_factory=list)
    submitted_version: int = 0

    @property
    def min_version(self) -> int:
        # a failed episode may hold no model token: it does not make its group stale
        return min((s.min_version for s in self.samples if s.model_versions), default=self.submitted_version)

    @property
    def trainable(self) -> list[Sample]:
        return [s for s in self.samples if s.failed is None]

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "submitted_version": self.submitted_version,
                "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> "Group":
        return cls(d["group_id"], [Sample.from_dict(s) for s in d["samples"]], d["submitted_version"])
