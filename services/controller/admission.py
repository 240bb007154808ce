"""Admission control: a group is admitted only while admitted <= (v + eta + 1) * B (dropped groups excluded)."""

from __future__ import annotations

from dataclasses import dataclass


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
