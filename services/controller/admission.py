"""Admission control: a group is admitted only while admitted <= (v + eta + 1) * B (dropped groups excluded)."""

from __future__ import annotations

from dataclasses import dataclass

# sorted set group_id -> oldest version its tokens can carry, over groups admitted but not yet trained or dropped.
# The controller adds a group at v_adm in the transaction that publishes it; a rollout worker lowers the score to the
# version it starts the group with (it may not have swapped to v_adm yet); the trainer removes the group in the
# transaction that records it in the ledger, and waits for any group that would otherwise pass eta_hard.
IN_FLIGHT = "in_flight"


@dataclass(slots=True)
class Admission:
    groups_per_step: int
    eta: int
    max_steps: int
    num_admitted: int = 0
    num_dropped: int = 0

    def num_allowed(self, version: int) -> int:
        """How many more groups may be admitted now that the trainer is at `version`."""
        bound = (version + self.eta + 1) * self.groups_per_step
        total = self.max_steps * self.groups_per_step
        live = self.num_admitted - self.num_dropped
        return max(0, min(bound, total) - live)
