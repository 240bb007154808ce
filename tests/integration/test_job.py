"""Whole jobs through `jetroll run` on a real Redis: smoke, kill-and-restart with a ledger audit, resume, bad input."""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import random
import re
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import torch
from helpers import JETROLL, aof_path, tensorboard_scalars, wandb_history
from job_harness import (
    SMOKE,
    Job,
    audit_ledger,
    check_summary,
    kill_service,
    launch,
    service_logs,
    service_pids,
    stop,
)

from jetroll.services.controller.sinks import scheme_name
from jetroll.services.launch.redis_server import RedisServer
from jetroll.shared.protocol.events import Array, MetricsEvent, decode, encode
from jetroll.shared.store.local import LocalWeightStore

pytestmark = [pytest.mark.integration, pytest.mark.job]

def _mutations(vocab: int) -> dict[str, list[tuple[str, Callable[[Any], Any], str]]]:
    """Per stream: (what, mutate a real event of that stream, a phrase of the dead letter's reason). Every mutation
    decodes and is invalid by construction, so no copy of a real event can be trained."""
    def arr(values: list, dtype: str) -> Array:
        return Array.of(values, dtype)  # type: ignore[arg-type]

    def traj(e: Any, **fields: Any) -> Any:
        return msgspec.structs.replace(e, **fields)

    def n(e: Any) -> int:
        return e.completion_ids.shape[0]

    trajectory = [
        ("a token id past the embedding", lambda e: traj(e, completion_ids=arr([vocab] * n(e), "<i4")),
         "completion_ids holds token ids outside"),
        ("arrays of different lengths", lambda e: traj(e, loss_mask=arr([1] * (n(e) + 1), "<u1")),
         "loss_mask has shape"),
        ("a NaN log-prob", lambda e: traj(e, behavior_logprobs=arr([float("nan")] * n(e), "<f4")), "behavior_logprobs"),
        ("a version from the future", lambda e: traj(e, v_tok=arr([10**6] * n(e), "<i4")), "v_tok spans"),
        ("a group of a million samples", lambda e: traj(e, group_size=10**6), "group_size 1000000"),
        ("an empty prompt", lambda e: traj(e, prompt_ids=arr([], "<i4")), "prompt_ids has 0 tokens"),
    ]
    return {
        "groups:default": [
            ("a token id past the embedding", lambda e: traj(e, prompt_ids=arr([vocab], "<i4")), "token ids outside"),
            ("an empty prompt", lambda e: traj(e, prompt_ids=arr([], "<i4")), "prompt_ids has 0 tokens"),
            ("a group of a million samples", lambda e: traj(e, group_size=10**6), "group_size 1000000"),
            ("a task the job does not run", lambda e: traj(e, task="nope"), "task 'nope'"),
        ],
        "traj:raw": trajectory,
        "traj:scored": [
            ("a NaN reward", lambda e: traj(e, reward=float("nan")), "reward nan"),
            ("a reward above 1", lambda e: traj(e, reward=7.0), "reward 7.0"),
            *[(what, lambda e, m=m: traj(e, trajectory=m(e.trajectory)), reason) for what, m, reason in trajectory],
        ],
        "weights": [
            ("a version past the job", lambda e: traj(e, version=10**6), "version 1000000 is outside"),
            ("a manifest outside the job's store", lambda e: traj(e, manifest_uri="file:///etc/passwd"),
             "is not this job's store"),
            ("weights the store does not hold", lambda e: traj(
                e, version=3, manifest_uri=e.manifest_uri.replace(f"v{e.version:08d}", "v00000003"),
                shard_sha256={"x": "0" * 64}), "version 3"),
        ],
        "metrics": [("a trainer step past the job", lambda e: traj(e, service="trainer", step=10**6),
                     "step 1000000 of a trainer metric is outside")],
    }


def test_bad_events_on_every_stream_are_dead_lettered(start_job: Callable[..., Job], redis_url: str,
                                                      model_path: str) -> None:
    """From the first step on, random bytes and mutated real events (each decodes, each invalid) go to every stream
    of a running job. The job finishes whole, and each one is in the dlq with its reason."""
    job = start_job()
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    client = redis.Redis.from_url(redis_url)
    rng = random.Random(0)
    injected: dict[str, tuple[str, str]] = {}  # entry id -> (stream, reason phrase)
    try:
        for stream, mutations in _mutations(vocab).items():
            key = f"jetroll:{job.job_id}:{stream}"
            first = job.wait_until(lambda k=key: client.xrange(k, count=1), f"a first entry on {stream}")
            real = decode(first[0][1][b"e"])
            for _, mutate, reason in mutations:
                event = mutate(real)
                injected[client.xadd(key, {b"e": encode(event)}).decode()] = (stream, reason)
            garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            injected[client.xadd(key, {b"e": b"\xc1" + garbage}).decode()] = (stream, "undecodable event")
            wrong_kind = MetricsEvent(job_id=job.job_id, service="test", values={"x": 1.0}, step=0)
            if stream != "metrics":
                injected[client.xadd(key, {b"e": encode(wrong_kind)}).decode()] = (stream, "got a MetricsEvent")
        assert job.wait() == 0, job.report()
        dlq = [{k.decode(): v for k, v in fields.items()} for _, fields in client.xrange(f"jetroll:{job.job_id}:dlq")]
    finally:
        client.close()
    summary = check_summary(job, max_steps=4, dead_letters=True)
    audit_ledger(redis_url, job.job_id, max_steps=4, groups_per_step=4, group_size=4)
    # `jetroll dlq` and the summary count them by stream and kind of reason
    listed = subprocess.run([*JETROLL, "dlq", job.job_id, "--redis-url", redis_url, "--json", "--list", "3"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert report["total"] == len(dlq) == sum(report["by_reason"].values()) and len(report["newest"]) == 3
    assert report["by_reason"] == summary["dead_letters"]
    assert report["by_reason"]["traj:scored: invalid ScoredEvent: reward N is outside [N, N]"] == 1
    reasons = {(r["stream"].decode(), r["entry_id"].decode()): r["reason"].decode() for r in dlq}
    for entry_id, (stream, phrase) in injected.items():
        assert (stream, entry_id) in reasons, f"{stream} {entry_id} ({phrase}) not dead-lettered: {reasons}"
        assert phrase in reasons[stream, entry_id], (phrase, reasons[stream, entry_id])
    assert {key for key in reasons if key[1] not in injected} == set(), "a real event was dead-lettered"


def test_smoke_fp8_unified(start_job: Callable[..., Job]) -> None:
    """Also the metric sinks: every metrics.jsonl column and each evaluation reach TensorBoard and W&B (offline)."""
    job = start_job("precision.mode=fp8_unified", "eval.every_steps=2", "metrics.sinks=[tensorboard, wandb]")
    assert job.wait() == 0, job.stderr()
    summary = check_summary(job, max_steps=4)
    evals = [json.loads(line) for line in (job.run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4]  # base, periodic (once its weights exist), final
    assert summary["precision"] == "fp8_unified"
    # the same FP8 tensors on both sides: the trainer matches the rollout at the same version
    assert summary["mismatch_mean_abs_logprob"] < 1e-3
    rows = job.metrics()
    # async: precision.mismatch.sample's rows are scored at the versions that sampled them, so every step measures
    assert all(r["mismatch_tokens"] > 0 and 0 < r["mismatch_coverage"] <= 1 for r in rows), rows
    assert all(math.isfinite(r["precision_mismatch"]) and math.isfinite(r["mismatch/k3"]) for r in rows)
    steps = [line for line in job.logs["stdout"].read_text().splitlines() if line.startswith("step ")]
    # off a terminal: the first step's line and the last's, and any other at most every PLAIN_LINE_EVERY_S
    assert steps[0].startswith("step 1/4 ") and steps[-1].startswith("step 4/4 "), steps
    assert not any("nan" in line for line in steps), steps
    scalars = tensorboard_scalars(job.run_dir / "tensorboard")
    history = wandb_history(job.run_dir / "wandb")
    for row in rows:
        logged = next(h for h in history if h.get("_step") == row["step"] and "timing/step_s" in h)
        for key, value in row.items():
            if key != "step" and not math.isnan(value):
                assert scalars[scheme_name(key)][row["step"]] == pytest.approx(value, rel=1e-6), key
                assert logged[scheme_name(key)] == pytest.approx(value), key
    assert scalars["timing/step_s"].keys() == {1, 2, 3, 4} and "reward/mean" in scalars and "actor/lr" in scalars
    assert {v: a for v, a in scalars["eval/accuracy/arithmetic"].items()} == {e["version"]: pytest.approx(
        e["arithmetic"]) for e in evals}
    assert [h["eval/accuracy/arithmetic"] for h in history if "eval/accuracy/arithmetic" in h] == \
        pytest.approx([e["arithmetic"] for e in evals])
    check_rescore(job, evals)


def check_rescore(job: Job, evals: list[dict]) -> None:
    """`jetroll eval` scores the job's weights again as its controller did (same problems, prompts and FP8
    numerics: the same figures), on as many problems as asked, and refuses a version the store let go."""
    weights = job.run_dir / "store" / job.job_id / "weights"
    held = sorted(int(p.name[1:]) for p in weights.glob("v*") if (p / "manifest.json").is_file())
    again = subprocess.run([*JETROLL, "eval", str(job.run_dir), "--json"], capture_output=True, text=True,
                           timeout=300, check=True)
    rows = json.loads(again.stdout)["rows"]
    assert [r["version"] for r in rows] == [e["version"] for e in evals if e["version"] in held] != []
    scored = {e["version"]: e["arithmetic"] for e in evals}
    for row in rows:
        assert row["arithmetic"] == scored[row["version"]] and row["num_problems"] == {"arithmetic": 20}, row
    wider = subprocess.run([*JETROLL, "eval", str(job.run_dir), "--json", "--versions", str(held[-1]),
                            "--num-problems", "60"], capture_output=True, text=True, timeout=300, check=True)
    (row,) = json.loads(wider.stdout)["rows"]
    assert row["version"] == held[-1] and row["num_problems"] == {"arithmetic": 60} and 0 <= row["arithmetic"] <= 1
    trained = subprocess.run([*JETROLL, "eval", str(job.run_dir), "--json", "--versions", str(held[-1]),
                              "--split", "train"], capture_output=True, text=True, timeout=300, check=True)
    (row,) = json.loads(trained.stdout)["rows"]
    assert row["num_problems"] == {"arithmetic": 20} and 0 <= row["arithmetic"] <= 1
    gone = min(set(range(held[-1])) - set(held))
    refused = subprocess.run([*JETROLL, "eval", str(job.run_dir), "--versions", str(gone)], capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and f"no longer holds version(s) [{gone}]" in refused.stderr, refused.stderr


# gates that any nonzero mismatch trips, each failing the job: an aligned exact job passes them all
TIGHT_GATES = ("precision.mismatch.gate.k3.above=1e-12", "precision.mismatch.gate.abs_mean.above=1e-9",
               "precision.mismatch.gate.growth.above=10", "precision.mismatch.gate.growth.floor=1e-15")


def test_smoke_fp8_unified_exact_async_has_zero_mismatch(start_job: Callable[..., Job]) -> None:
    """Rollout loads the published FP8 bytes; on the exact backend every same-version log-prob matches bitwise. In
    async mode the sampled rows are scored with the kept weights of the versions that sampled them: bitwise too.
    (The sync case runs in `test_smoke_sync_...` below, one job for both checks.)"""
    job = start_job("precision.mode=fp8_unified", "precision.backend=exact", "staleness.mode=async", *TIGHT_GATES)
    assert job.wait() == 0, job.stderr()
    check_zero_mismatch(job, "async")


def check_zero_mismatch(job: Job, mode: str) -> None:
    """A finished fp8_unified exact job measured every scored token at 0, and published FP8 weights."""
    summary = check_summary(job, max_steps=4)
    assert summary["mismatch_mean_abs_logprob"] == 0.0
    assert summary["mismatch_coverage"] == 1.0 if mode == "sync" else 0 < summary["mismatch_coverage"] < 1
    for row in job.metrics():
        assert row["mismatch/tokens"] > 0 and row["mismatch/abs_max"] == row["mismatch/k3"] == 0.0
    version = job.run_dir / "store" / job.job_id / "weights" / "v00000004"
    assert json.loads((version / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


@pytest.mark.parametrize("failing", ["k3", "abs_mean", "growth"])
def test_each_mismatch_gate_catches_a_misaligned_refit(failing: str, start_job: Callable[..., Job]) -> None:
    """The quantizer misaligned on purpose: every version after the base publishes FP8 weights quantized from a bf16
    copy, while the trainer's forward quantizes the fp32 masters. Both sides agree on that plan, so no byte or plan
    check can see it: the gates must. Sync mode on the exact backend: step 1 (the base) measures exactly 0, step 2
    the misalignment. The failing gate stops the job with its one line, the others warn."""
    actions = [f"precision.mismatch.gate.{gate}.action={'fail' if gate == failing else 'warn'}"
               for gate in ("k3", "abs_mean", "growth")]
    job = start_job("precision.mode=fp8_unified", "precision.backend=exact", "staleness.mode=sync",
                    "precision.refit_source=bf16_copy", *TIGHT_GATES, *actions)
    assert job.wait() != 0, job.report()
    rows = job.metrics()
    assert [r["step"] for r in rows] == [1, 2]  # the failing step's row is written; its weights never serve
    assert rows[0]["mismatch/k3"] == 0.0 and rows[0]["mismatch/tokens"] > 0 and rows[1]["mismatch/k3"] > 0
    tripped = [{name for name in row if name.startswith("mismatch_gate/")} for row in rows]
    assert tripped == [set(), {"mismatch_gate/k3", "mismatch_gate/abs_mean", "mismatch_gate/growth"}]
    figure = {"k3": "mismatch k3 ", "abs_mean": "mismatch abs_mean ", "growth": "mismatch k3 grew "}
    failed = [line for line in job.stderr().splitlines() if "failed the job" in line]
    assert len(failed) == 1 and failed[0].startswith(
        f"jetroll: service trainer failed the job: precision mismatch gate: {figure[failing]}"), job.stderr()
    assert "at step 2" in failed[0] and f"precision.mismatch.gate.{failing}.above" in failed[0]
    trainer_log = job.service_log("trainer")
    for gate in {"k3", "abs_mean", "growth"} - {failing}:
        assert f"precision.mismatch.gate.{gate}.above" in trainer_log, (gate, trainer_log[-2000:])


def test_smoke_sync_exact_has_zero_lag_zero_mismatch_and_a_warmed_up_cosine_lr(start_job: Callable[..., Job]) -> None:
    """Two checks on one sync job (merged by issue 50; neither setting touches what the other checks): the lag and
    the lr schedule, and fp8_unified's zero mismatch on the exact backend with every token measured."""
    job = start_job("staleness.mode=sync", "trainer.lr_schedule=cosine", "trainer.lr=1e-3", "trainer.warmup_steps=2",
                    "trainer.lr_decay_frac=0.5", "precision.mode=fp8_unified", "precision.backend=exact",
                    *TIGHT_GATES)
    assert job.wait() == 0, job.stderr()
    check_zero_mismatch(job, "sync")
    summary = check_summary(job, max_steps=4)
    rows = job.metrics()
    # two warm-up steps, then the decay over the last half of the steps: the lr the trainer stepped with
    assert [r["lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert all(r["lag_max"] == 0 for r in rows), [r["lag_max"] for r in rows]
    assert all(r["mismatch_coverage"] == 1.0 for r in rows)
    assert summary["mismatch_coverage"] == 1.0


@pytest.mark.slow
def test_nothing_lost_when_services_are_killed(start_job: Callable[..., Job], redis_url: str) -> None:
    """The acceptance test: SIGKILL rollout, reward and the controller twice mid-run; the job finishes, every step's
    row is written once and the ledger is whole."""
    max_steps = 10
    job = start_job(f"trainer.max_steps={max_steps}", "redis.ledger_keep_groups=3")
    killed: dict[str, int | None] = {"rollout": None, "reward": None, "controller": None}
    for num_rounds, at_step in enumerate((2, 6), start=1):
        job.wait_until(lambda n=at_step: len(job.metrics()) >= n, f"{at_step} steps")
        for kind in killed:
            killed[kind] = kill_service(job, kind, not_pid=killed[kind])
        job.wait_until(lambda n=num_rounds: job.stderr().count("died (exit -9)") >= len(killed) * n, "the restarts")
    assert job.wait() == 0, f"{job.stderr()}\n{service_logs(job.run_dir)}"
    stderr = job.stderr()
    for name in ("rollout-default-0", "reward", "controller"):
        assert f"service {name} died (exit -9); restart 1/3" in stderr, stderr
        assert f"service {name} died (exit -9); restart 2/3" in stderr, stderr
    check_summary(job, max_steps)
    # a ledger keeping 3 outcomes: the audit covers the groups folded into its totals
    totals = audit_ledger(redis_url, job.job_id, max_steps, groups_per_step=4, group_size=4, keep_groups=3)
    assert totals.num_dropped == 0, totals  # rewards never fail here


def redis_server_pid(job: Job) -> int | None:
    """The pid of the job's own redis-server, found by its port (the server rewrites its command line to
    `redis-server 127.0.0.1:PORT`)."""
    match = re.search(r"\(redis redis://127\.0\.0\.1:(\d+)/0", job.stderr())
    if match is None:
        return None
    title = f"redis-server 127.0.0.1:{match.group(1)}".encode()
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if args and args[0].endswith(title):
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_job_survives_a_restart_of_its_redis(tmp_path: Path, model_path: str) -> None:
    """SIGKILL the job's own Redis mid-run: the launcher restarts it on its port from its append-only file, the
    services reconnect, and the job finishes with every step's row and a whole ledger, read back from that file."""
    max_steps = 8
    job = launch(tmp_path, None, model_path, f"trainer.max_steps={max_steps}")
    try:
        job.wait_until(lambda: len(job.metrics()) >= 2, "2 steps")
        first = job.wait_until(lambda: redis_server_pid(job), "the job's redis-server")
        os.kill(first, signal.SIGKILL)
        job.wait_until(lambda: "service redis died (exit -9); restart 1/3" in job.stderr(), "the restart")
        assert job.wait() == 0, job.report()
    finally:
        stop(job)
    assert job.stderr().count(" died ") == 1, job.stderr()  # the services rode the outage out: none died
    check_summary(job, max_steps)
    with RedisServer(data_dir=job.run_dir / "redis") as server:  # the job's Redis, from its file
        totals = audit_ledger(server.url, job.job_id, max_steps, groups_per_step=4, group_size=4)
    assert totals.num_dropped == 0, totals


def aof_commands(data: bytes) -> Iterator[tuple[int, list[bytes]]]:
    """(offset, args) of each command of an append-only file (RESP arrays of bulk strings)."""
    pos = 0
    while pos < len(data):
        start, end = pos, data.index(b"\r\n", pos)
        assert data[pos:pos + 1] == b"*", data[pos:pos + 20]
        args, pos = [], end + 2
        for _ in range(int(data[start + 1:end])):
            end = data.index(b"\r\n", pos)
            length = int(data[pos + 1:end])
            args.append(data[end + 2:end + 2 + length])
            pos = end + 2 + length + 2
        yield start, args


def cut_aof_before_step(redis_dir: Path, job_id: str, step: int) -> None:
    """Truncate the job's append-only file before the transaction that first recorded `step` in its ledger: what a
    machine crash leaves of Redis' last second of writes (everything after a point, whole transactions)."""
    path = aof_path(redis_dir)
    data = path.read_bytes()
    totals, multi = f"jetroll:{job_id}:ledger:totals".encode(), 0
    for offset, args in aof_commands(data):
        if args[0].upper() == b"MULTI":
            multi = offset
        if args[0].upper() == b"HSET" and args[1] == totals and int(args[args.index(b"max_step") + 1]) >= step:
            path.write_bytes(data[:multi])
            return
    pytest.fail(f"no ledger record of step {step} in {path} (rewritten into its base?)")


@pytest.mark.slow
def test_a_redis_that_lost_its_last_writes_trains_nothing_twice(tmp_path: Path, model_path: str) -> None:
    """A machine crash loses the last second of the job's Redis (AOF everysec) but not the store. Cut the file
    before step 5's ledger record of a finished 8-step job, then run the job on to 12 steps: the trainer re-records
    steps 5-8 from the store's step records, so their scored entries, redelivered unacked, are not trained again;
    the controller, its count rolled back, does not run those groups again; every group is recorded once."""
    first = launch(tmp_path, None, model_path, "trainer.max_steps=8")
    try:
        assert first.wait() == 0, first.report()
    finally:
        stop(first)
    cut_aof_before_step(first.run_dir / "redis", first.job_id, 5)
    job = launch(tmp_path, None, model_path, "trainer.max_steps=12", job_id=first.job_id, run_dir=first.run_dir)
    try:
        assert job.wait() == 0, job.report()
    finally:
        stop(job)
    assert "not admitting" in job.service_log("controller"), job.service_log("controller")
    records = asyncio.run(LocalWeightStore(job.run_dir / "store", job.job_id).step_records())
    assert [r.version for r in records] == list(range(1, 13))
    times_trained = Counter(g for r in records for g in r.groups)
    assert max(times_trained.values()) == 1, [g for g, n in times_trained.items() if n > 1]
    with RedisServer(data_dir=job.run_dir / "redis") as server:
        totals = audit_ledger(server.url, job.job_id, 12, groups_per_step=4, group_size=4)
    assert totals.num_dropped == 0, totals


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs, unmounted at the end (mounting one needs root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"a size-limited tmpfs needs root: mount said {result.stderr.strip()!r}")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=False)


def fill(path: Path) -> None:
    """Write `path` until its file system has no room left."""
    with path.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


@pytest.mark.slow
def test_a_full_store_fails_the_job_cleanly_and_it_resumes_once_there_is_room(
    tmp_path: Path, model_path: str, small_disk: Path
) -> None:
    """The local store on a tmpfs that fills up mid-job: the trainer fails the job at once with a message saying
    so (no restart loop), LATEST names a version that verifies and no visible version is half-written. With the
    space back, the same command resumes, on the job's own Redis restored from its file, and the ledger is whole."""
    job_id, run_dir, max_steps = f"t{uuid.uuid4().hex[:8]}", tmp_path / "run", 8
    args = (f"store.root={small_disk}", f"trainer.max_steps={max_steps}")
    job = launch(tmp_path, None, model_path, *args, job_id=job_id, run_dir=run_dir)
    try:
        job.wait_until(lambda: len(job.metrics()) >= 3, "3 steps")
        fill(small_disk / "filler")
        code = job.wait()
    finally:
        stop(job)
    stderr = job.stderr()
    assert code != 0 and "service trainer failed the job: the weight store ran out of space" in stderr, stderr
    assert "restart 1/" not in stderr, stderr
    store = LocalWeightStore(small_disk, job_id)
    latest = asyncio.run(store.latest())
    assert latest is not None and 3 <= latest < max_steps, latest
    for version in asyncio.run(store.versions()):  # every version with a manifest is whole
        asyncio.run(store.fetch(version))
    assert max(asyncio.run(store.versions())) <= latest + 1
    (small_disk / "filler").unlink()
    again = launch(tmp_path, None, model_path, *args, job_id=job_id, run_dir=run_dir)
    try:
        assert again.wait() == 0, again.report()
    finally:
        stop(again)
    assert "resumed from checkpoint step" in again.service_log("trainer")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == max_steps
    with RedisServer(data_dir=run_dir / "redis") as server:
        totals = audit_ledger(server.url, job_id, max_steps, groups_per_step=4, group_size=4)
    assert totals.num_dropped == 0, totals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_job_and_its_services(start_job: Callable[..., Job], signum: signal.Signals) -> None:
    """`kill PID` of `jetroll run` stops every service it started, instead of leaving them orphaned; so does
    `kill -INT` of a job a shell started in the background (SIGINT ignored at start)."""
    job = start_job("trainer.max_steps=200", ignore_sigint=signum == signal.SIGINT)
    job.wait_until(lambda: len(job.metrics()) >= 2, "2 steps")
    assert service_pids(None, job.config_path), "no services to stop"
    job.process.send_signal(signum)
    assert job.process.wait(timeout=60) == 130, job.stderr()
    assert "interrupted; stopping services" in job.stderr()
    assert service_pids(None, job.config_path) == []


def test_restart_limit_names_the_service(start_job: Callable[..., Job]) -> None:
    job = start_job("trainer.max_steps=200", "launch.max_restarts=1")
    first = kill_service(job, "reward")
    job.wait_until(lambda: "service reward died (exit -9); restart 1/1" in job.stderr(), "the restart")
    kill_service(job, "reward", not_pid=first)
    assert job.wait(60) == 1
    last = job.stderr().strip().splitlines()[-1]
    assert last.startswith("jetroll: service reward died (exit -9) after 1 restarts"), last
    assert not service_pids(None, job.config_path), "the launcher left services running"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("key", "service"), [("trainer.device", "trainer"), ("rollout.device", "rollout-default-0")])
def test_a_device_the_machine_lacks_fails_the_job_once(start_job: Callable[..., Job], key: str, service: str) -> None:
    """The service that reads the field fails with one line, and the launcher does not restart it."""
    job = start_job(f"{key}=cuda")
    assert job.wait(120) != 0
    assert f"service {service} failed the job: {key} is cuda, but this torch" in job.stderr(), job.stderr()
    assert "restart 1/" not in job.stderr()


@dataclass
class ResumedRun:
    job_id: str
    run_dir: Path
    first: Job
    second: Job


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, redis_url: str, model_path: str) -> Iterator[ResumedRun]:
    """A 4-step job checkpointed every 2 steps, then the same job id and run dir asked for 6 steps."""
    workdir = tmp_path_factory.mktemp("resume")
    run_dir, job_id = workdir / "run", f"r{uuid.uuid4().hex[:8]}"
    first = launch(workdir, redis_url, model_path, "trainer.checkpoint_every=2", "trainer.max_steps=4",
                   job_id=job_id, run_dir=run_dir)
    try:
        assert first.wait() == 0, first.stderr()
        second = launch(workdir, redis_url, model_path, "trainer.checkpoint_every=2", "trainer.max_steps=6",
                        job_id=job_id, run_dir=run_dir)
        try:
            assert second.wait() == 0, f"{second.stderr()}\n{service_logs(run_dir)}"
            yield ResumedRun(job_id, run_dir, first, second)
        finally:
            stop(second)
    finally:
        stop(first)


def test_trainer_resumes_from_checkpoint(resumed: ResumedRun, redis_url: str) -> None:
    run_dir, job_id = resumed.run_dir, resumed.job_id
    assert "resumed from checkpoint step 4 at version 4" in resumed.second.service_log("trainer")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    weights = run_dir / "store" / job_id / "weights"
    assert int((weights / "LATEST").read_text()) == 6
    checkpoints = run_dir / "store" / job_id / "checkpoints"
    assert {p.name for p in checkpoints.iterdir()} == {"step00000000", "step00000002", "step00000004", "step00000005",
                                                       "step00000006"}
    client = redis.Redis.from_url(redis_url)
    try:
        ledger = {k.decode(): json.loads(v) for k, v in client.hgetall(f"jetroll:{job_id}:ledger").items()}
    finally:
        client.close()
    steps = sorted(o["step"] for o in ledger.values() if o["status"] == "trained")
    assert steps == sorted(list(range(1, 7)) * 4)
    assert [int(r["step"]) for r in resumed.second.metrics()][-2:] == [5, 6]


def test_resume_logs_each_step_once(resumed: ResumedRun) -> None:
    assert [int(r["step"]) for r in resumed.second.metrics()] == list(range(1, 7))


def _run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*JETROLL, "run", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(("override", "key"), [("trainer.lr=-1", "trainer.lr"),
                                               ("trainer.bogus=1", "trainer.bogus")])
def test_bad_override_exits_2_naming_the_key(override: str, key: str, tmp_path: Path) -> None:
    result = _run_cli(str(SMOKE), "--set", override, "--run-dir", str(tmp_path / "run"), tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_unknown_top_level_key_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMOKE.read_text() + "\nbogus_section:\n  x: 1\n")
    result = _run_cli(str(bad), tmp_path=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bogus_section" in lines[0] and "unknown key" in lines[0], result.stderr


@pytest.mark.parametrize("alarm_min", [200, 10**6], ids=["alarm", "alarm-off"])
def test_dead_letter_alarm_fails_a_job_whose_events_mostly_go_to_the_dlq(
    start_job: Callable[..., Job], redis_url: str, alarm_min: int
) -> None:
    """A flood of undecodable trajectories (what a schema skew between rollout and the router sends) outnumbers the
    samples trained: at the default `redis.dlq_alarm_min` the controller fails the job at once, without a restart,
    naming the commonest reason; with the alarm out of reach the same job finishes."""
    job = start_job("trainer.max_steps=300", "trainer.checkpoint_every=100", f"redis.dlq_alarm_min={alarm_min}")
    client = redis.Redis.from_url(redis_url)
    raw = f"jetroll:{job.job_id}:traj:raw"
    try:
        job.wait_until(lambda: client.exists(raw) and client.xinfo_groups(raw), "the reward consumer group")
        with client.pipeline(transaction=False) as pipe:
            for i in range(12000):  # more than the job trains in the alarm's 10 s window
                pipe.xadd(raw, {b"e": b"\xc1skew" + str(i).encode()})
            pipe.execute()
        code = job.wait()
    finally:
        client.close()
    stderr = job.stderr()
    if alarm_min == 10**6:
        assert code == 0, job.report()
        assert json.loads((job.run_dir / "summary.json").read_text())["steps"] == 300
        return
    assert code != 0, job.report()
    assert "job failed:" in job.service_log("controller") or "job failed:" in stderr, job.report()
    assert "events went to the dlq, more than the samples recorded" in job.service_log("controller") + stderr
    assert "traj:raw: undecodable event" in job.service_log("controller") + stderr
    # the launcher names the reason itself, and does not restart the controller
    assert "service controller failed the job: " in stderr and "events went to the dlq" in stderr, stderr
    assert "restart 1/" not in stderr, stderr
