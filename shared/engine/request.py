"""A request: one sample for an engine to generate, and what generating it recorded; and what its environment
reported, which the engine never reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Request:
    """One sample to generate. temperature == 0 means greedy."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # mu_t = log_softmax(logits / T)[token], untruncated
    versions: list[int] = field(default_factory=list)  # weight version that produced each token
    finish_reason: str | None = None
    turn_end_id: int | None = None  # multi-turn: this token ends a model turn and pauses the sequence
    observations: list[tuple[int, int]] = field(default_factory=list)  # (start, length) of env tokens in output_ids
    sampling_key: int = field(default=0, init=False)  # set by Engine.add: its seed and request_id, hashed

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def loss_mask(self) -> list[int]:
        """1 per sampled token, 0 per observation token."""
        mask = [1] * len(self.output_ids)
        for start, length in self.observations:
            mask[start : start + length] = [0] * length
        return mask

    def append_observation(self, observation_ids: list[int], version: int) -> None:
        """Append an environment's observation after a model turn: loss_mask 0, log-prob 0, tagged `version`."""
        self.observations.append((len(self.output_ids), len(observation_ids)))
        self.output_ids += observation_ids
        self.logprobs += [0.0] * len(observation_ids)
        self.versions += [version] * len(observation_ids)


@dataclass(frozen=True, slots=True)
class EnvResult:
    """What a sample's environment reported: its status (anything but `ok` makes the reward router record env_fail)
    and its own reward, when it gave one."""

    status: str = "ok"
    reward: float | None = None


def has_room_after(request: Request, observation_ids: list[int], max_len: int) -> bool:
    """Whether a model turn still fits after appending an observation: in the sample's budget and in the context."""
    return (len(request.output_ids) + len(observation_ids) < request.max_new_tokens
            and request.num_tokens + len(observation_ids) < max_len)
