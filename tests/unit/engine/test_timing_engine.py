"""The timing-model engine: lognormal draws, time per token in chunks, versions across a swap, failing environments."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from jetroll.shared.config.rollout import TimingEngineConfig
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.timing import TimingEngine, draw

EOS, VOCAB = 1, 50


def run(engine: TimingEngine, requests: list[Request]) -> dict[str, float]:
    """Step until done; seconds from start to each request's finish."""
    started = time.monotonic()
    engine.add(requests)
    finished_at = {}
    while engine.has_work:
        for request in engine.step():
            finished_at[request.request_id] = time.monotonic() - started
    return finished_at


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_draws_are_lognormal_with_the_configured_mean_and_cv(cv: float) -> None:
    config = TimingEngineConfig(mean_tokens=400, cv=cv, max_tokens=1 << 30)
    lengths = np.array([draw(config, f"g{i:07d}:0").num_tokens for i in range(20_000)], dtype=np.float64)
    assert lengths.mean() == pytest.approx(400, rel=0.05 * (1 + cv))
    assert lengths.std() / lengths.mean() == pytest.approx(cv, rel=0.15 * (1 + cv))
    assert np.log(lengths).std() == pytest.approx(math.sqrt(math.log1p(cv**2)), rel=0.03)


def test_draws_are_a_pure_function_of_seed_and_traj_id() -> None:
    config = TimingEngineConfig(fail_frac=0.5)
    assert draw(config, "g0000001:3") == draw(config, "g0000001:3")
    other_seed = config.model_copy(update={"seed": 1})
    assert [draw(config, f"g{i}:0").num_tokens for i in range(20)] != [
        draw(other_seed, f"g{i}:0").num_tokens for i in range(20)]


def test_samples_finish_after_their_length_times_the_token_time() -> None:
    config = TimingEngineConfig(mean_tokens=200, cv=1.0, token_time_s=2e-4, chunk_tokens=16)
    engine = TimingEngine(config, EOS, VOCAB, max_batch=16, max_len=1024)
    requests = [Request(f"g0000001:{i}", [3, 4], 8) for i in range(12)]
    finished_at = run(engine, requests)
    chunk_s = config.chunk_tokens * config.token_time_s
    for request in requests:
        fate = draw(config, request.request_id)
        expected_s = math.ceil(fate.num_tokens / config.chunk_tokens) * chunk_s  # ends on a chunk boundary
        assert expected_s - 1e-3 <= finished_at[request.request_id] <= expected_s + 0.1  # late only on a busy CPU
        assert len(request.output_ids) == len(request.logprobs) == len(request.versions) == fate.num_tokens
        assert request.output_ids[-1] == EOS and request.finish_reason == "stop"
        assert all(2 <= t < VOCAB for t in request.output_ids[:-1])  # no special token inside a completion
        assert all(lp <= 0 for lp in request.logprobs)


def test_slots_bound_concurrency() -> None:
    config = TimingEngineConfig(mean_tokens=64, cv=0.0, token_time_s=2e-3)
    engine = TimingEngine(config, EOS, VOCAB, max_batch=2, max_len=1024)
    finished_at = run(engine, [Request(f"g0000001:{i}", [3], 8) for i in range(4)])
    one_s = 64 * config.token_time_s
    times = sorted(finished_at.values())
    assert one_s <= times[1] < 1.5 * one_s and 2 * one_s <= times[3] < 2.5 * one_s  # two waves of two


def test_a_swap_tags_later_tokens_with_the_new_version() -> None:
    config = TimingEngineConfig(mean_tokens=400, cv=0.0, token_time_s=2e-4, chunk_tokens=16)
    engine = TimingEngine(config, EOS, VOCAB, max_batch=4, max_len=1024)
    requests = [Request(f"g0000001:{i}", [3], 8) for i in range(2)]
    engine.add(requests)
    while not any(r.versions for r in requests):
        engine.step()
    time.sleep(0.02)
    engine.swap_weights({}, version=1)
    run(engine, [])
    for request in requests:
        num_old = request.versions.count(0)
        assert request.versions == [0] * num_old + [1] * (400 - num_old)
        assert num_old % config.chunk_tokens == 0 and 0 < num_old < 400  # swapped on a chunk boundary mid-way


def test_failing_environments_are_flagged_and_slow() -> None:
    # 0.1 s against 0.4 s: a loaded machine's scheduling delays stay well inside the 3x the test asks for
    config = TimingEngineConfig(mean_tokens=100, cv=0.0, token_time_s=1e-3, fail_frac=0.5, fail_slowdown=4.0)
    engine = TimingEngine(config, EOS, VOCAB, max_batch=32, max_len=1024)
    requests = [Request(f"g0000002:{i}", [3], 8) for i in range(32)]
    finished_at = run(engine, requests)
    env = {r.request_id: engine.env_result(r.request_id) for r in requests}
    failed = [r for r in requests if env[r.request_id].status != "ok"]
    assert 0 < len(failed) < len(requests)
    assert all(env[r.request_id].status == "error" and draw(config, r.request_id).is_env_fail for r in failed)
    assert all(not draw(config, r.request_id).is_env_fail for r in requests if r not in failed)
    slowest_ok = max(finished_at[r.request_id] for r in requests if env[r.request_id].status == "ok")
    assert min(finished_at[r.request_id] for r in failed) > 3 * slowest_ok


def test_a_capped_length_finishes_with_length() -> None:
    config = TimingEngineConfig(mean_tokens=64, cv=0.0, max_tokens=32, token_time_s=1e-4)
    engine = TimingEngine(config, EOS, VOCAB, max_batch=1, max_len=1024)
    request = Request("g0000001:0", [3], 8)
    run(engine, [request])
    assert len(request.output_ids) == 32 and request.finish_reason == "length" and request.output_ids[-1] != EOS
