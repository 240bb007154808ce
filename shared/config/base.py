"""Config basics: parsing a CLI list (strict models are jetroll.shared.schema's)."""

from __future__ import annotations

from jetroll.shared.errors import ConfigError


def comma_ints(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of integers given to `option` (a CLI flag), or a ConfigError naming it."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a comma-separated list of integers") from None
