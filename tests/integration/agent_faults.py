"""Agents that fail on purpose, for the agent job's fault tests: by a hash of the question, one problem in four
hangs (its session's deadline ends it), one in four raises, and the rest run the calculator agent."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from examples.calculator_agent import run as calculator_agent


async def flaky(problem: Any, client: Any) -> float:
    kind = zlib.crc32(problem.prompt.encode()) % 4
    if kind == 0:
        await asyncio.sleep(3600)
    if kind == 1:
        raise RuntimeError("the tool crashed")
    return await calculator_agent(problem, client)
