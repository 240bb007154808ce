"""AWS Lambda backend: one aioboto3 `invoke` (RequestResponse) per call, at most one handler run per traj_id.

- botocore retries are off: the router retries throttling (429) itself and nothing else, since any other failure
  may come from a handler that ran.
- The read timeout exceeds the function timeout, so the client never gives up on a handler that is still running.
- A record per traj_id in the job's Redis (SET NX) makes the call idempotent: a repeat call returns the recorded
  outcome, and a call whose earlier invocation never recorded one (a router died mid-invoke) is an error rather
  than a second invocation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

import aioboto3
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError, ReadTimeoutError

from jetroll.services.reward.backends.base import RECORD_TTL_S, Outcome, RewardBackend, RewardCall
from jetroll.shared.protocol.call_records import INVOKING, LambdaRecords

THROTTLE_CODES = frozenset({"TooManyRequestsException"})


class LambdaBackend(RewardBackend):
    """Reward calls as synchronous Lambda invocations; `endpoint_url` points at any Invoke-API server."""

    name = "lambda"
    can_retry_failures = False  # a Lambda timeout or error may have run the handler

    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str,
        default_function: str,
        functions: Mapping[str, str],
        endpoint_url: str | None,
        region: str,
        read_timeout_s: float,
        concurrency: int,
    ) -> None:
        super().__init__(concurrency)
        self.default_function = default_function
        self.functions = dict(functions)
        self.endpoint_url = endpoint_url
        self.region = region
        self.read_timeout_s = read_timeout_s
        self.records = LambdaRecords(redis_url, key_prefix, RECORD_TTL_S)
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def start(self) -> None:
        config = AioConfig(
            read_timeout=self.read_timeout_s,
            connect_timeout=10,
            retries={"mode": "standard", "total_max_attempts": 1},
            max_pool_connections=self.concurrency,
        )
        self._client = await self._stack.enter_async_context(
            aioboto3.Session().client("lambda", region_name=self.region, endpoint_url=self.endpoint_url,
                                      config=config)
        )

    async def close(self) -> None:
        await self._stack.aclose()
        await self.records.close()

    async def _score(self, call: RewardCall) -> Outcome:
        assert self._client is not None, "LambdaBackend.start() was not called"
        recorded = await self.records.claim(call.traj_id)
        if recorded == INVOKING:
            return Outcome("error", detail="an earlier invocation for this traj_id recorded no outcome; "
                                           "not invoking twice")
        if recorded is not None:
            return Outcome.from_reply(json.loads(recorded))
        outcome = await self._invoke(call)
        if outcome.status == "throttled":
            await self.records.release(call.traj_id)  # the handler did not run: the router's retry may invoke
        else:
            await self.records.keep(call.traj_id, {"status": outcome.status, "reward": outcome.reward,
                                                   "correct": outcome.correct, "detail": outcome.detail})
        return outcome

    async def _invoke(self, call: RewardCall) -> Outcome:
        function = self.functions.get(call.reward, self.default_function)
        try:
            response = await self._client.invoke(FunctionName=function, InvocationType="RequestResponse",
                                                 Payload=json.dumps(call.request()).encode())
            body = await response["Payload"].read()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = error.get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in THROTTLE_CODES or status == 429:
                return Outcome("throttled", detail=f"{code}: {error.get('Message', '')}")
            return Outcome("error", detail=f"{function}: {code}: {error.get('Message', '')}")
        except ReadTimeoutError as exc:
            return Outcome("timeout", detail=f"no response within {self.read_timeout_s}s ({exc}); not retried")
        except BotoCoreError as exc:
            return Outcome("error", detail=f"{function}: {type(exc).__name__}: {exc}")
        if response.get("FunctionError"):
            return _function_error(function, body)
        try:
            result = json.loads(body)
        except ValueError:
            return Outcome("error", detail=f"{function} returned non-JSON: {body[:200]!r}")
        return Outcome.from_reply({"status": "ok", **result} if isinstance(result, dict) else result)


def _function_error(function: str, body: bytes) -> Outcome:
    """A function error payload: Lambda's timeout report is a `timeout`, anything else an `error`."""
    try:
        error = json.loads(body)
    except ValueError:
        error = {"errorMessage": body[:200].decode(errors="replace")}
    if not isinstance(error, dict):
        error = {"errorMessage": str(error)}
    message, kind = str(error.get("errorMessage", "")), str(error.get("errorType", ""))
    status = "timeout" if "Task timed out" in message or kind == "Sandbox.Timedout" else "error"
    return Outcome(status, detail=f"{function}: {kind}: {message}".replace(": : ", ": "))
