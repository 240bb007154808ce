"""`--help` of every command and bench prints its usage: a help string is a %-format, so a bare `%` in one breaks
the whole command's help."""

from __future__ import annotations

import pytest

from jetroll.bench.cli import BENCHES
from jetroll.services.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"],
                                  *(["bench", name, "--help"] for name in sorted(BENCHES))])
def test_help_prints_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: jetroll")
