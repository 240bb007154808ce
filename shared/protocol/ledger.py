"""The ledger: each admitted group's outcome (trained, or dropped with its reward status), recorded once by the trainer.

Training is exactly-once per group: the trainer records a group before it acks the group's entries, and acks any
later copy of a recorded group untrained. Memory stays bounded: every group below the ledger's *prefix* (the longest
run of recorded groups from admission index 1) is known recorded by its index alone, so only the newest `keep_groups`
outcomes of the prefix stay in the outcomes hash, beside the groups recorded above it (out of order); the totals
count every group ever recorded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from jetroll.shared.protocol.bus import RedisBus
from jetroll.shared.protocol.ids import GROUP_ID, admission_index
from jetroll.shared.protocol.topology import IN_FLIGHT, LEDGER, LEDGER_TOTALS

# KEYS: outcomes hash, totals hash, in-flight set. ARGV: GROUP_ID, keep_groups, then per group: id, status,
# num_samples, step, outcome JSON. A group is counted only when it is first recorded: not in the prefix, not in the
# hash. Then the prefix moves over the recorded groups after it, deleting outcomes more than keep_groups behind.
_RECORD = """
local fmt, keep = ARGV[1], tonumber(ARGV[2])
local prefix = tonumber(redis.call('HGET', KEYS[2], 'prefix') or 1)
local max_step = tonumber(redis.call('HGET', KEYS[2], 'max_step') or 0)
for i = 3, #ARGV, 5 do
  local group_id, status = ARGV[i], ARGV[i + 1]
  local digits = string.match(group_id, '%d+$')
  local in_prefix = digits ~= nil and string.format(fmt, tonumber(digits)) == group_id and tonumber(digits) < prefix
  if not in_prefix and redis.call('HSETNX', KEYS[1], group_id, ARGV[i + 4]) == 1 then
    redis.call('HINCRBY', KEYS[2], 'groups:' .. status, 1)
    redis.call('HINCRBY', KEYS[2], 'samples:' .. status, ARGV[i + 2])
    max_step = math.max(max_step, tonumber(ARGV[i + 3]))
  end
  redis.call('ZREM', KEYS[3], group_id)
end
while redis.call('HEXISTS', KEYS[1], string.format(fmt, prefix)) == 1 do
  if prefix > keep then redis.call('HDEL', KEYS[1], string.format(fmt, prefix - keep)) end
  prefix = prefix + 1
end
redis.call('HSET', KEYS[2], 'prefix', prefix, 'max_step', max_step)
"""


@dataclass(frozen=True, slots=True)
class Outcome:
    step: int  # trained: the version its step made; dropped: the trainer's version when it was dropped
    status: str  # "trained" or "dropped:<final reward status>"
    num_samples: int  # the group's trajectories the trainer held


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """Every group ever recorded, folded or not."""

    num_groups: dict[str, int]  # status -> groups
    num_samples: dict[str, int]  # status -> their trajectories
    prefix: int  # every group with an admission index below it is recorded
    max_step: int  # the highest step recorded

    @property
    def num_samples_recorded(self) -> int:
        """Samples of every recorded group, trained or dropped."""
        return sum(self.num_samples.values())

    @property
    def num_dropped(self) -> int:
        return sum(n for status, n in self.num_groups.items() if status.startswith("dropped:"))

    def dropped_by_status(self) -> dict[str, int]:
        return {status.removeprefix("dropped:"): n for status, n in sorted(self.num_groups.items())
                if status.startswith("dropped:")}


class Ledger:
    """The ledger of one job on its bus; the trainer writes it, others read it."""

    def __init__(self, bus: RedisBus) -> None:
        self.bus = bus
        self._record = bus.redis.register_script(_RECORD)

    async def recorded(self, group_ids: set[str]) -> set[str]:
        """Which of `group_ids` are in the ledger (one round trip)."""
        ids = sorted(group_ids)
        if not ids:
            return set()
        async with self.bus.redis.pipeline(transaction=True) as pipe:  # one view: a fold moves groups to the prefix
            pipe.hmget(self.bus.key(LEDGER), ids)
            pipe.hget(self.bus.key(LEDGER_TOTALS), "prefix")
            found, prefix = await pipe.execute()
        below = int(prefix or 1)
        return {g for g, outcome in zip(ids, found, strict=True)
                if outcome is not None or (index := admission_index(g)) is not None and index < below}

    async def record(self, outcomes: dict[str, Outcome], *, keep_groups: int) -> None:
        """Record each group not yet recorded and take it out of the in-flight set, in one atomic script; keep the
        outcomes of the newest `keep_groups` groups of the prefix."""
        if keep_groups < 0:
            raise ValueError(f"keep_groups must be >= 0, got {keep_groups}")
        args: list[Any] = [GROUP_ID, keep_groups]
        for group, outcome in outcomes.items():
            args += [group, outcome.status, outcome.num_samples, outcome.step, json.dumps(asdict(outcome))]
        keys = [self.bus.key(LEDGER), self.bus.key(LEDGER_TOTALS), self.bus.key(IN_FLIGHT)]
        await self._record(keys=keys, args=args)

    async def outcomes(self) -> dict[str, Outcome]:
        """The outcomes still kept: the newest of the prefix and every group recorded above it."""
        raw = await self.bus.redis.hgetall(self.bus.key(LEDGER))
        return {k.decode(): Outcome(**json.loads(v)) for k, v in raw.items()}

    async def totals(self) -> LedgerTotals:
        raw = {k.decode(): int(v) for k, v in (await self.bus.redis.hgetall(self.bus.key(LEDGER_TOTALS))).items()}
        return LedgerTotals(
            num_groups={k.removeprefix("groups:"): v for k, v in raw.items() if k.startswith("groups:")},
            num_samples={k.removeprefix("samples:"): v for k, v in raw.items() if k.startswith("samples:")},
            prefix=raw.get("prefix", 1), max_step=raw.get("max_step", 0))
