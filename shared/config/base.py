"""Config basics: strict models, and the errors every config problem raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, reported as one line that names the offending key."""


class WarmStartError(RuntimeError):
    """The warm start could not land the base model in `model.warm_start.target_band`; nothing was cached."""


JOB_FAILED_EXIT = 65  # EX_DATAERR: a service found the job cannot succeed; its launcher does not restart it


class JobFailedError(RuntimeError):
    """A service found that the job cannot succeed (e.g. the dead-letter alarm); it exits with JOB_FAILED_EXIT."""


def comma_ints(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of integers given to `option` (a CLI flag), or a ConfigError naming it."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a comma-separated list of integers") from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
