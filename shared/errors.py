"""The errors a job's parts report to the user, below every room: config problems, a failed warm start, a job that
cannot succeed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem, reported as one line that names the offending key."""


class WarmStartError(RuntimeError):
    """The warm start could not land the base model in `model.warm_start.target_band`; nothing was cached."""


JOB_FAILED_EXIT = 65  # EX_DATAERR: a service found the job cannot succeed; its launcher does not restart it


class JobFailedError(RuntimeError):
    """A service found that the job cannot succeed (e.g. the dead-letter alarm); it exits with JOB_FAILED_EXIT."""
