"""staleness: the bound on how old a token's weights may be when it is trained on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from jetroll.shared.schema import Strict


class StalenessConfig(Strict):
    """The staleness bound (docs/architecture.md, "Staleness and versions"): admission keeps groups within eta versions;
    the trainer waits for the oldest in-flight group rather than let it pass eta_hard = 2 eta, and masks (and counts)
    any token still beyond eta_hard."""

    mode: Literal["async", "sync"] = Field("async", description="sync is the barrier baseline (eta = 0)")
    max_staleness: int = Field(2, ge=0, description="eta: admit while admitted <= (v + eta + 1) * B")

    @property
    def eta(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @property
    def eta_hard(self) -> int:
        """Largest token lag the trainer trains on; later tokens are masked and counted."""
        return eta_hard_of(self.eta)


def eta_hard_of(eta: int) -> int:
    """A staleness bound's hard lag: a group admitted at most eta versions back trains within eta more."""
    return 2 * eta
