"""Config basics: strict models, and parsing a CLI list."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from jetroll.shared.errors import ConfigError


def comma_ints(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of integers given to `option` (a CLI flag), or a ConfigError naming it."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a comma-separated list of integers") from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskMixEntry(Strict):
    """What every kind of `tasks` entry has besides its name: its share of the mix and its own staleness bound."""

    weight: float = Field(1.0, gt=0, description="relative sampling weight in the task mix")
    max_staleness: int | None = Field(
        None, ge=0, description="the task's own eta (None: staleness.max_staleness): its groups are waited for, and "
        "its tokens masked, only past twice this lag, and its share of the admission window grows with it; a slow "
        "environment's task takes a larger one, so that it neither stalls the trainer nor loses its groups "
        "(docs/architecture.md, \"Many tasks in one job\"). Async mode only")
