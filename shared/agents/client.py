"""The agent's side of a session: run a user's agent against its session's API and report how it ended (the
environment workers, an evaluation).

An agent is a coroutine `async def run(problem: Problem, client: openai.AsyncOpenAI) -> AgentResult | float`.
`client` points at the episode's gateway session (shared/agents/gateway.py). An agent that raises, or runs past its
timeout, ends its session with env status `error` or `timeout`: its group is dropped and counted, never given a
reward of 0.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jetroll.shared.agents.wire import EpisodeOutcome, end_url
from jetroll.shared.tasks.agent import EXTRA, AgentResult
from jetroll.shared.tasks.base import Problem

for _name in ("httpx", "httpx2"):  # the openai client's HTTP library logs every request at INFO
    logging.getLogger(_name).setLevel(logging.WARNING)


async def run_agent(agent: Any, problem: Problem, url: str, timeout_s: float) -> EpisodeOutcome:
    """Run `agent` on `problem` against the session at `url`, under `timeout_s`; never raises."""
    try:
        import openai
    except ImportError:
        return EpisodeOutcome("error", None, EXTRA)
    client = openai.AsyncOpenAI(base_url=url, api_key="jetroll", max_retries=0, timeout=timeout_s)
    try:
        result = await asyncio.wait_for(agent(problem, client), timeout_s)
    except TimeoutError:
        return EpisodeOutcome("timeout", None, f"the agent ran past its {timeout_s:g} s")
    except Exception as exc:  # the agent's failure is its episode's env status, never a lost worker
        return EpisodeOutcome("error", None, f"{type(exc).__name__}: {exc}"[:500])
    finally:
        await client.close()
    reward = result.reward if isinstance(result, AgentResult) else result
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not 0 <= reward <= 1:
        return EpisodeOutcome("error", None, f"the agent returned {result!r:.80}: not an AgentResult or a reward "
                                             "in [0, 1]")
    return EpisodeOutcome("ok", float(reward))


async def end_session(url: str, outcome: EpisodeOutcome, timeout_s: float = 10.0) -> bool:
    """Report an episode's outcome to its session (`url` is the session's API base); False when the gateway does
    not take it (gone, or the session already ended)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.post(end_url(url), json=outcome.body()) as response:
                return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


class InlineAgents:
    """Agents run as tasks of this event loop (evaluation, the warm start's probe, tests): `launch` runs one on the
    session at `url`; `drain` waits for every agent launched. The rollout worker publishes each episode to the
    environment workers instead."""

    def __init__(self, agent: Any, timeout_s: float) -> None:
        self.agent = agent
        self.timeout_s = timeout_s
        self.running: set[asyncio.Task[None]] = set()

    def launch(self, url: str, problem: Problem) -> None:
        async def episode() -> None:
            await end_session(url, await run_agent(self.agent, problem, url, self.timeout_s))

        task = asyncio.get_running_loop().create_task(episode())
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self.running)
