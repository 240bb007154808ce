"""`jetroll bench learning`'s cell matrix: which job seed runs on which base, for a count or a list of seeds."""

from __future__ import annotations

import pytest

from jetroll.bench.learning import cells, parse_seeds
from jetroll.shared.errors import ConfigError


def test_a_count_names_seeds_from_zero_and_a_list_names_its_own() -> None:
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("3,4") == [3, 4]
    assert parse_seeds("5,") == [5]


@pytest.mark.parametrize("text", ["0", "x", "3,3", "-1,2", ","])
def test_bad_seeds_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds(text)


def test_each_kernel_pairs_the_seeds_with_other_bases() -> None:
    matrix = cells([3, 4, 7], ["avx2", "native"])
    assert [(c["kernel"], c["seed"], c["warm_start_seed"]) for c in matrix] == [
        ("avx2", 3, 3), ("avx2", 4, 4), ("avx2", 7, 7), ("native", 3, 4), ("native", 4, 7), ("native", 7, 3)]
    # a count keeps the matrix the bench ran before seeds could be listed: warm-start seed (seed + k) mod N
    assert [c["warm_start_seed"] for c in cells(parse_seeds("3"), ["avx2", "native"])] == [0, 1, 2, 1, 2, 0]
