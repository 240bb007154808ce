"""Ray driver checks for test_ray_launcher.py, run as a subprocess so that pytest itself never joins a Ray cluster:
Ray's background threads (Serve handle metrics, the core worker) would outlive the test inside pytest.

usage: ray_probe.py ADDRESS JOB_ID, then one command per stdin line (`replicas N TARGET` or `gone`), each answered
with one JSON line on stdout. It joins the cluster before the first command, so a check costs no connection time."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE"] = "0"  # no metrics thread in a short-lived driver

import ray  # noqa: E402
from ray import serve  # noqa: E402


def replicas(app: str, num_replicas: int, target: int, timeout_s: float = 150.0) -> dict:
    """Watch the pool from the job's start until each of its `num_replicas` replicas answers `version()` with
    `target` or later through the app handle. Watching, not one look once the target is reached: a short job can
    publish its last step and tear the app down within the seconds a first look takes (status, handle, routing).
    Returns Serve's RUNNING count then and each replica's answer, or {"error": ...} when the app went away first."""
    deadline = time.monotonic() + timeout_s
    handle = None
    answers: dict[str, int] = {}
    while time.monotonic() < deadline:
        applications = serve.status().applications
        if handle is not None and app not in applications:
            return {"error": f"{app} went away before every replica served v{target}", "answers": answers}
        deployment = applications[app].deployments.get("rollout-default") if app in applications else None
        if deployment is None or not deployment.replica_states.get("RUNNING"):
            time.sleep(0.2)
            continue
        handle = handle or serve.get_app_handle(app)
        answer = handle.version.remote().result(timeout_s=30)  # the router picks a replica per call
        if answer["version"] is not None:
            answers[answer["replica"]] = answer["version"]
        if len(answers) == num_replicas and min(answers.values()) >= target:
            return {"running": deployment.replica_states.get("RUNNING", 0), "answers": answers}
        time.sleep(0.05)
    return {"error": f"no {num_replicas} replicas at v{target} within {timeout_s} s", "answers": answers}


def gone(app: str, job_id: str) -> dict:
    """Whether the app and the job's named actors still exist."""
    actors = {}
    for kind in ("trainer", "reward"):
        try:
            ray.get_actor(f"jetroll-{job_id}-{kind}")
            actors[kind] = True
        except ValueError:
            actors[kind] = False
    return {"app": app in serve.status().applications, "actors": actors}


def main() -> None:
    address, job_id = sys.argv[1:3]
    app = f"jetroll-{job_id}-default"
    ray.init(address=address, log_to_driver=False, logging_level="warning")
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            check, *args = line.split()
            result = replicas(app, int(args[0]), int(args[1])) if check == "replicas" else gone(app, job_id)
            print(json.dumps(result), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
