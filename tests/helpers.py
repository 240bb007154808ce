"""Helpers the test modules share (pytest puts tests/ on sys.path through its conftest.py)."""

from __future__ import annotations

import sys

JETROLL = [sys.executable, "-m", "jetroll.services.cli"]  # the CLI, as a subprocess of the interpreter under test
