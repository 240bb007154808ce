"""Group ids: a group's id is a pure function of its admission index, so every service orders and folds groups
without asking Redis. No Redis here: the algorithm room (`shared/rl`) imports this."""

from __future__ import annotations

import re

GROUP_ID = "g%07d"  # a group's id from its admission index 1, 2, ...: ids sort in admission order


def group_id(index: int) -> str:
    """The id of the group admitted `index`-th (from 1)."""
    return GROUP_ID % index


def admission_order(group: str) -> tuple[int, str]:
    """Sort key that puts the controller's ids in admission order: zero-padded to 7 digits, an id grows longer only
    past index 10^7, so a shorter id was admitted earlier (plain string order would put g10000000 first)."""
    return len(group), group


def admission_index(group: str) -> int | None:
    """The admission index of an id `group_id` made, else None (such a group is never folded)."""
    digits = re.search(r"\d+$", group)
    return int(digits[0]) if digits and group_id(int(digits[0])) == group else None
