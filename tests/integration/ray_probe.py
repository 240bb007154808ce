"""Ray driver checks for test_ray_launcher.py, run as a subprocess so that pytest itself never joins a Ray cluster:
Ray's background threads (Serve handle metrics, the core worker) would outlive the test inside pytest.

usage: ray_probe.py ADDRESS JOB_ID, then one command per stdin line (`replicas N` or `gone`), each answered with one
JSON line on stdout. It joins the cluster before the first command, so a check costs no connection time."""

from __future__ import annotations

import json
import os
import sys

os.environ["RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE"] = "0"  # no metrics thread in a short-lived driver

import ray  # noqa: E402
from ray import serve  # noqa: E402


def replicas(app: str, num_replicas: int) -> dict:
    """Serve's RUNNING count for the pool, and each replica's answer to `version()` through the app handle."""
    deployment = serve.status().applications[app].deployments["rollout-default"]
    handle = serve.get_app_handle(app)
    answers: dict[str, int] = {}
    for _ in range(40):  # the router picks a replica per call; collect an answer from each
        answer = handle.version.remote().result(timeout_s=30)
        answers[answer["replica"]] = answer["version"]
        if len(answers) == num_replicas:
            break
    return {"running": deployment.replica_states.get("RUNNING", 0), "answers": answers}


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
            result = replicas(app, int(args[0])) if check == "replicas" else gone(app, job_id)
            print(json.dumps(result), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
