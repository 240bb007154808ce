"""CI smoke of `jetroll bench engine`, `store`, `reward`, `mismatch` and `async`: tiny sizes, so the benchmarks cannot
rot. Speed is not asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import JETROLL

from jetroll.bench.precision import ARMS, DEFAULT_ARMS, GATES

pytestmark = [pytest.mark.integration, pytest.mark.job]

FAKE_LAMBDA = Path(__file__).resolve().parents[1] / "fakes" / "lambda_invoke.py"
REPO = Path(__file__).resolve().parents[2]


def test_bench_engine_json_smoke() -> None:
    out = subprocess.run(
        [*JETROLL, "bench", "engine", "--json", "--batch-sizes", "1,2",
         "--new-tokens", "8", "--repeats", "1", "--threads", "1", "--no-compile", "--swap-shapes", "tiny"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["batch_size"] for row in result["rows"]] == [1, 2]
    has_vllm = importlib.util.find_spec("vllm") is not None
    for row in result["rows"]:
        assert row["hf_tokens_per_s"] > 0 and row["jetroll_fp32_tokens_per_s"] > 0
        assert row["jetroll_fp8_tokens_per_s"] > 0
        assert (row["vllm_tokens_per_s"] > 0) if has_vllm else row["vllm_tokens_per_s"] is None
    if has_vllm:  # the swap's cost on both engines
        assert {shape: set(cost) for shape, cost in result["swap"].items()} == {"tiny": {"params", "jetroll", "vllm"}}
        assert all(cost[e]["pause_to_resume_s"] > 0 for cost in result["swap"].values() for e in ("jetroll", "vllm"))
    summary = result["summary"]
    assert {"speedup_b1", "speedup_b64", "fp8_over_fp32"} <= set(summary)
    assert summary["speedup_b1"] > 0


def test_bench_store_json_smoke() -> None:
    out = subprocess.run(
        [*JETROLL, "bench", "store", "--json", "--synthetic-mb", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {(row["case"], row["backend"]) for row in result["rows"]} == {
        ("default", "local"), ("synthetic", "local"), ("default", "s3"), ("synthetic", "s3")}
    for row in result["rows"]:
        assert row["store_s"] > 0 and row["essential_s"] > 0 and row["ratio"] > 0
        assert row["size_bytes"] >= (2_000_000 if row["case"] == "synthetic" else 1)
    summary = result["summary"]
    assert {"local_ratio", "s3_ratio", "is_within_max"} <= set(summary)
    assert summary["local_ratio"] > 0 and summary["s3_ratio"] > 0


def test_bench_reward_json_smoke() -> None:
    """Every backend, lambda against the fake Invoke API run as a source checkout runs it; no endpoint, no lambda."""
    fake = subprocess.Popen([sys.executable, str(FAKE_LAMBDA), "--port", "0", "--concurrency", "1"],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert fake.stdout is not None
        url = json.loads(fake.stdout.readline())["url"]
        out = subprocess.run(
            [*JETROLL, "bench", "reward", "--json", "--calls", "8", "--concurrency", "1,2", "--workers", "1",
             "--lambda-endpoint", url],
            capture_output=True, text=True, timeout=300, check=True,
        )
    finally:
        fake.terminate()
        fake.wait(timeout=30)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {(row["backend"], row["concurrency"]) for row in result["rows"]} == {
        (backend, level) for backend in ("local", "inline", "celery", "lambda") for level in (1, 2)}
    for row in result["rows"]:
        assert row["rewards_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["not_ok"] == 0
    assert set(result["summary"]["overhead_ms"]) == {"inline", "celery", "lambda"}
    refused = subprocess.run([*JETROLL, "bench", "reward", "--backends", "lambda"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "needs --lambda-endpoint" in refused.stderr, refused.stderr


def test_bench_mismatch_json_smoke() -> None:
    out = subprocess.run(
        [*JETROLL, "bench", "mismatch", "--json", "--lengths", "8,16", "--samples", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {(row["mode"], row["length"]) for row in result["rows"]} == {
        (mode, length) for mode in ("bf16", "fp8_unified", "fp8_rollout_only") for length in (8, 16)}
    for row in result["rows"]:
        assert row["tokens"] == 2 * row["length"]
        if row["mode"] != "fp8_rollout_only":  # one flow on both sides: exactly equal log-probs
            assert row["abs_max"] == row["k3"] == row["seq_delta_abs_mean"] == row["tis_clip_frac"] == 0.0
    summary = result["summary"]
    assert summary["unified_max_abs_delta"] == 0.0 and summary["bf16_max_abs_delta"] == 0.0
    assert len(summary["rollout_only_seq_delta_by_length"]) == 2
    assert all(d > 0 for d in summary["rollout_only_seq_delta_by_length"])


def test_bench_async_quick_json_smoke() -> None:
    out = subprocess.run([*JETROLL, "bench", "async", "--json", "--quick"],
                         capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(row["mode"], row["eta"]) for row in result["rows"]] == [("sync", 0), ("async", 2)]
    sync, fast = result["rows"]
    assert sync["lag"]["max"] == 0 and sync["rollout_frac"] == 1.0 and 0 < sync["efficiency"]
    assert 0 < fast["rollout_frac"] < 1 and fast["lag"]["max"] <= 4 and fast["stale_masked_tokens"] == 0
    for row in result["rows"]:
        assert row["trajectories_per_s"] > 0 and row["bound"] > 1
        assert 0 <= row["trainer_idle_frac"] <= 1 and 0 <= row["rollout_idle_frac"] <= 1
    summary = result["summary"]
    assert {"speedup_cv1_eta2", "bound_cv1_eta2", "max_lag_cv1_eta2"} <= set(summary)
    assert summary["speedup_cv1_eta2"] > 0


@pytest.mark.slow
def test_bench_precision_json_smoke_and_resume(tmp_path: Path) -> None:
    """Two steps per arm on a 1-layer model built in tmp: each job runs its arm's precision with every gate warning,
    each step is measured per task; a second call resumes from the saved runs."""
    cmd = [*JETROLL, "bench", "precision", "--json", "--seeds", "1", "--max-steps", "2",
           "--run-dir", str(tmp_path / "runs"), "--set", "model.num_layers=1", "--set", "model.warm_start.max_steps=2",
           "--set", "model.warm_start.init_from.max_steps=2", "--set", "model.warm_start.init_from.target_band=null",
           "--set", f"model.cache_dir={tmp_path / 'cache'}", "--set", "eval.num_problems=1",
           "--set", "trainer.groups_per_step=2", "--set", "trainer.group_size=2",
           # eager decode: the compiled path's numerics are test_engine.py's, and 4 arms' compiles were a third of this
           "--set", "rollout.compile=false"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    assert [(run["arm"], run["seed"]) for run in first["runs"]] == [(arm, 0) for arm in DEFAULT_ARMS]
    for run in first["runs"]:  # each job ran with its arm's precision, not the config file's
        job = json.loads((tmp_path / "runs" / f"{run['arm']}-seed0" / "config.json").read_text())["precision"]
        assert {field: job[field] for field in ARMS[run["arm"]]} == ARMS[run["arm"]]
        assert {gate["action"] for gate in job["mismatch"]["gate"].values()} == {"warn"}
        # sync mode measures every step: a growth from the second on
        assert run["measured_steps"] == run["steps"] == 2 and run["growth_final"] is not None
        assert run["k3_first"] == run["k3_curve"][0] and run["k3_last"] == run["k3_curve"][1]
        assert len(run["reward_curve"]) == len(run["k3_curve"]) == 2 and set(run["first_trip"]) == set(GATES)
        assert set(run["per_task"]) == {"arithmetic", "count32"}
    assert first["runs"][DEFAULT_ARMS.index("fp8_unified_exact")]["k3_max"] == 0.0  # bitwise on the exact backend
    assert set(first["summary"]["arms"]) == set(DEFAULT_ARMS) and "score_minus_bf16" in first["summary"]
    assert (tmp_path / "runs" / "precision.png").stat().st_size > 0
    started = time.perf_counter()
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert again["runs"] == first["runs"] and time.perf_counter() - started < 60  # nothing ran again
    other = subprocess.run([*cmd, "--set", "trainer.lr=0.5"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "holds precision-bench runs of another config" in other.stderr, other.stderr
    unknown = subprocess.run([*cmd, "--arms", "bf16,fp4"], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "unknown precision-bench arm(s) ['fp4']" in unknown.stderr, unknown.stderr


@pytest.mark.slow
def test_bench_learning_json_smoke_and_resume(tmp_path: Path) -> None:
    """One trainer seed, named as a list, on both kernel variants, 2 RL steps of a 1-layer model: each cell is a real
    `jetroll run` from its own cold cache, the avx2 cell really runs AVX2 kernels, and a second call runs nothing
    again."""
    cmd = [*JETROLL, "bench", "learning", "--json", "--seeds", "2,", "--max-steps", "2",
           "--run-dir", str(tmp_path / "bench"), "--set", "model.num_layers=1", "--set", "model.warm_start.max_steps=4",
           "--set", "model.warm_start.target_band=null", "--set", "model.warm_start.probe_problems=20",
           "--set", "eval.num_problems=20", "--set", "eval.every_steps=1", "--set", "trainer.groups_per_step=2",
           "--set", "trainer.group_size=2", "--set", "rollout.compile=false"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    rows = first["rows"]
    assert [(r["kernel"], r["seed"], r["warm_start_seed"]) for r in rows] == [("avx2", 2, 2), ("native", 2, 2)]
    assert rows[0]["cpu_capability"] == "AVX2" and rows[1]["cpu_capability"] != ""
    for row in rows:
        assert row["steps"] == 2 and row["warm_start_steps"] == 4 and row["eval_problems"] == {"arithmetic": 20}
        assert [step for step, _ in row["evals"]] == [0, 1, 2]
        assert row["lowest"] == min(a for _, a in row["evals"]) and row["rise"] == row["final"] - row["base"]
        assert row["wall_s"] > row["base_build_s"] > 0
        assert (tmp_path / "bench" / f"{row['kernel']}-s2-w2" / "cache").is_dir()  # a cold cache per cell
    assert first["summary"]["min_final"] == min(r["final"] for r in rows)
    assert first["summary"]["min_rise"] == min(r["rise"] for r in rows)
    assert first["versions"]["torch"].startswith("2.13.0")
    assert first["summary"]["commits"] == sorted({str(r["commit"]) for r in rows})
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert again["rows"] == rows
    other = subprocess.run([*cmd, "--set", "trainer.lr=0.5"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "holds learning-bench runs of another config" in other.stderr, other.stderr


@pytest.mark.slow
def test_bench_chaos_json_smoke_and_resume(tmp_path: Path) -> None:
    """60 steps of a 1-layer job on a moto S3 store: every service SIGKILLed (the trainer twice), the Redis killed
    and S3 cut, each at its seeded step; the job ends with nothing trained twice and nothing lost, and a second call
    runs nothing again."""
    from jetroll.bench.chaos import FAULTS

    cmd = [*JETROLL, "bench", "chaos", "--json", "--seed", "3", "--max-steps", "60", "--outage-s", "3",
           "--run-dir", str(tmp_path / "bench"), "--set", f"model.cache_dir={tmp_path / 'cache'}",
           "--set", "model.num_layers=1", "--set", "model.warm_start.max_steps=4",
           "--set", "model.warm_start.target_band=null", "--set", "model.warm_start.probe_problems=20",
           "--set", "eval.num_problems=20", "--set", "trainer.groups_per_step=2", "--set", "trainer.group_size=2",
           "--set", "trainer.checkpoint_every=20", "--set", "rollout.compile=false", "--set", "rollout.max_batch=16",
           "--set", "redis.claim_idle_ms=2000"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    (row,) = first["rows"]
    assert sorted(f["kind"] for f in row["faults"]) == sorted(FAULTS)
    for fault in row["faults"]:
        assert fault["fired_at_step"] >= fault["step"] and fault["recovery_s"] > 0, fault
    (outage,) = [f for f in row["faults"] if f["kind"] == "s3"]
    assert outage["recovery_s"] >= 3.0, outage  # the cut itself counts
    log = (tmp_path / "bench" / "seed3" / "job.log").read_text()
    for kind, times in (("trainer", 2), ("rollout-default-0", 1), ("reward", 1), ("controller", 1), ("redis", 1)):
        assert log.count(f"service {kind} died (exit -9)") == times, (kind, log)
    assert row["steps"] == row["steps_recorded"] == 60
    assert row["trained_twice"] == 0 and row["lost"] == 0, row
    assert row["trained_once"] == row["ledger_trained"] == 60 * 2, row
    assert row["admitted"] == row["trained_once"] + row["dropped"], row
    again = json.loads(subprocess.run([*cmd, "--fault-free", "1"], capture_output=True, text=True, timeout=600,
                                      check=True).stdout)
    assert again["rows"] == [row]  # the faulted run is not run again; the fault-free one runs beside it
    (clean,) = again["fault_free_rows"]
    assert clean["faults"] == [] and clean["steps_recorded"] == 60, clean
    assert clean["trained_twice"] == 0 and clean["lost"] == 0 and clean["trained_once"] == 60 * 2, clean
    assert "died" not in (tmp_path / "bench" / "seed3-fault-free0" / "job.log").read_text()
    assert again["summary"]["fault_free_mean"] == clean["accuracy_after"]
    assert again["summary"]["faulted_minus_mean"] == row["accuracy_after"] - clean["accuracy_after"]


PEERS_SMOKE = ["bench", "peers", "--json", "--steps", "6", "--seeds", "1,", "--kernels", "native", "--eval-every", "3",
               "--eval-problems", "20", "--probe-steps", "4", "--set", "model.num_layers=1",
               "--set", "model.warm_start.max_steps=4", "--set", "model.warm_start.target_band=null",
               "--set", "model.warm_start.probe_problems=20", "--set", "eval.num_problems=20",
               "--set", "trainer.groups_per_step=2", "--set", "trainer.group_size=2", "--set", "rollout.compile=false"]


@pytest.mark.slow
def test_bench_peers_json_smoke_and_resume(tmp_path: Path) -> None:
    """6 steps of a 1-layer job in jetroll and in TRL's GRPOTrainer from one base: both sides' clocks, CPU samples
    and evaluations come back, the same base scores the same on both, and a second call runs nothing again."""
    cmd = [*JETROLL, *PEERS_SMOKE, "--run-dir", str(tmp_path / "bench")]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    rows = first["rows"]
    assert [(r["side"], r["kernel"], r["seed"]) for r in rows] == [("jetroll", "native", 1), ("trl", "native", 1)]
    probe = first["trl_thread_probes"]["native"]
    assert set(probe["s_per_step"]) == {"1", "2"} and rows[1]["threads"] == int(min(probe["s_per_step"],
                                                                                      key=probe["s_per_step"].get))
    for row in rows:
        assert row["steps"] == 6 and [step for step, _ in row["evals"]] == [0, 3, 6]
        assert row["s_per_step"] > 0 and row["completions_per_s"] > 0 and row["tokens_per_s"] > 0
        assert row["final"] == row["evals"][-1][1]
    assert rows[0]["evals"][0] == rows[1]["evals"][0]  # one base, one evaluation
    assert set(rows[0]["trainer"]) >= {"step_time_s", "stage_s", "stale_wait_s", "trainer_wait_s"}
    assert 0 < rows[0]["rollout_slot_occupancy"] <= 1
    ratio = first["summary"]["per_kernel"]["native"]["step_ratio"]
    assert ratio == rows[0]["s_per_step"] / rows[1]["s_per_step"]
    assert first["versions"]["trl"] == "1.16.0" and first["versions"]["cpu_count"] >= 1
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert again["rows"] == rows
    other = subprocess.run([*cmd, "--eval-every", "2"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "holds peers-bench runs of other settings" in other.stderr, other.stderr


@pytest.mark.slow
def test_bench_peers_smoke_of_the_second_job(tmp_path: Path) -> None:
    """`--config configs/dataset_math.yaml` with its chat template: the BPE model's prompts rendered by the template on
    both sides (the TRL side refuses to start unless its ids are jetroll's), crossing times at `--thresholds`, and
    time per step as the only bar of a job other than the default."""
    cmd = [*JETROLL, "bench", "peers", "--json", "--config", str(REPO / "configs" / "dataset_math.yaml"),
           "--thresholds", "0.05,0.5", "--steps", "4", "--seeds", "0,", "--kernels", "native", "--eval-every", "2",
           "--eval-problems", "16", "--trl-threads", "1", "--probe-steps", "2", "--run-dir", str(tmp_path / "bench"),
           *(arg for item in ("model.chat_template=true", "model.num_layers=1",
                              "model.warm_start.max_steps=4", "model.warm_start.target_band=null",
                              "model.warm_start.probe_problems=16", "eval.num_problems=16",
                              "trainer.groups_per_step=2", "trainer.group_size=2", "rollout.compile=false")
             for arg in ("--set", item))]
    result = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    assert result["config"]["thresholds"] == [0.05, 0.5] and result["config"]["config"].endswith("dataset_math.yaml")
    jet, trl = result["rows"]
    assert jet["evals"][0] == trl["evals"][0] and [s for s, _ in trl["evals"]] == [0, 2, 4]
    for row in (jet, trl):
        assert set(row) >= {"time_to_5_s", "time_to_50_s"} and row["steps"] == 4 and row["tokens_per_s"] > 0
    native = result["summary"]["per_kernel"]["native"]
    assert set(native["bars"]) == {"step_ratio"}
    assert native["bars"]["step_ratio"] == (native["step_ratio"] <= 1 / 1.5)


def test_bench_peers_without_trl_fails_in_one_line(tmp_path: Path) -> None:
    blocked = ("import sys; sys.modules['trl'] = None; from jetroll.services.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", blocked, *PEERS_SMOKE, "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["jetroll: bench peers needs TRL, and trl does not import: pip install "
                                               "'jetroll[peers]'"]


AGENTIC_SMOKE = ["bench", "agentic", "--json", "--seeds", "1", "--max-steps", "6", "--set", "model.num_layers=1",
                 "--set", "model.warm_start.max_steps=4", "--set", "model.warm_start.target_band=null",
                 "--set", "model.warm_start.probe_problems=8", "--set", "eval.num_problems=8",
                 "--set", "eval.every_steps=3", "--set", "trainer.groups_per_step=3", "--set", "trainer.group_size=2",
                 "--set", "rollout.compile=false", "--set", "tasks.1.env_faults.delay_s=0.05"]


@pytest.mark.slow
def test_bench_agentic_json_smoke_and_resume(tmp_path: Path) -> None:
    """6 steps of the multi-environment job per cell (the bench measures those after its 5 warm-up steps), pipeline,
    barrier and TRL, flaky on and off, from one base: every cell trains every task, the barrier runs one pool in
    sync mode, the flaky pool counts its episodes and set-up share (TRL's single loop too), and a second call runs
    nothing again."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("reasoning_gym")
    cmd = [*JETROLL, *AGENTIC_SMOKE, "--run-dir", str(tmp_path / "bench")]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout)
    rows = first["rows"]
    assert [(r["arm"], r["flaky"]) for r in rows] == [("pipeline", True), ("barrier", True), ("trl", True),
                                                      ("pipeline", False), ("barrier", False), ("trl", False)]
    for row in rows:
        assert row["steps"] == 6 and row["trajectories_per_s"] > 0 and 0 <= row["trainer_idle_frac"] <= 1
        assert set(row["trajectories_per_s_by_task"]) == {"frozenlake", "calculator", "chain_sum"}
        assert [e["version"] for e in row["evals"]] == [0, 3, 6]
        assert ("staleness.mode=sync" in row["overrides"]) == (row["arm"] == "barrier")
    pipeline_flaky, barrier_flaky, trl_flaky, pipeline_steady, _, trl_steady = rows
    assert set(pipeline_flaky["pools"]) == {"lake", "tools", "sums"} and set(barrier_flaky["pools"]) == {"default"}
    tools = pipeline_flaky["pools"]["tools"]
    assert tools["env_episodes/ok"] > 0 and 0 < tools["env_setup_share/ok"] < 1  # 50 ms resets are a share
    assert "tasks.1.env_faults=null" in pipeline_steady["overrides"]
    # TRL's loop: every sample of every step, an episode with its environment for each multi-turn one
    for row, name in ((trl_flaky, "trl-flaky-s0"), (trl_steady, "trl-steady-s0")):
        assert set(row["pools"]) == {"trl"} and row["steps"] == 6
        by_task = Counter()
        for line in (tmp_path / "bench" / name / "rollouts.jsonl").read_text().splitlines():
            by_task.update(json.loads(line)["by_task"])
        assert sum(by_task.values()) == 6 * 3 * 2
        pool = row["pools"]["trl"]
        assert pool["env_episodes/ok"] + pool.get("env_episodes/failed", 0) == by_task["frozenlake"] + by_task[
            "calculator"] > 0
    assert trl_flaky["pools"]["trl"]["env_setup_share/ok"] > trl_steady["pools"]["trl"]["env_setup_share/ok"]
    summary = first["summary"]
    for setting in ("flaky", "steady"):
        pipeline = summary[setting]["pipeline"]["trajectories_per_s"]
        assert summary[setting]["speedup"] == pipeline / summary[setting]["barrier"]["trajectories_per_s"]
        assert summary[setting]["speedup_over_trl"] == pipeline / summary[setting]["trl"]["trajectories_per_s"]
    assert set(summary["pipeline_flaky_over_steady_by_task"]) == {"frozenlake", "calculator", "chain_sum"}
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout)
    assert again["rows"] == rows
    other = subprocess.run([*cmd[:-2], "--set", "tasks.1.env_faults.delay_s=0.1", *cmd[-2:]], capture_output=True,
                           text=True, timeout=300)
    assert other.returncode == 2 and "holds agentic-bench runs of another config" in other.stderr, other.stderr
