"""docker-compose.yml and the Dockerfile, checked without a Docker daemon: the compose spec, every service command a
real jetroll command, depends_on targets and conditions, images and ports, the stack's job config, and the
Dockerfile's install, user, entrypoint and GPU build arg."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from helpers import JETROLL

from jetroll.services.cli import build_parser
from jetroll.shared.config.job import load_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
BIN = Path(sys.executable).parent  # the venv's bin: check-jsonschema and the jetroll entry point live beside python
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def interpolate(value: str) -> str:
    """Compose's variable syntax with every variable unset: ${VAR:-default} and ${VAR-default} become the default."""
    value = re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)
    return value.replace("$$", "$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def built(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The jetroll services: those built from the Dockerfile."""
    return {name: svc for name, svc in services.items() if "build" in svc}


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    parser = DockerfileParser(path=str(DOCKERFILE))
    assert parser.structure, "the Dockerfile parsed to nothing"
    return parser


def instructions(dockerfile: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in dockerfile.structure if i["instruction"] == name]


@pytest.mark.integration  # a subprocess
def test_compose_file_matches_the_compose_spec() -> None:
    checker = BIN / "check-jsonschema"
    assert checker.exists(), f"{checker} missing: install the dev extra (pip install -e '.[dev]')"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration  # a subprocess
def test_every_jetroll_service_runs_a_real_jetroll_command(built: dict[str, dict[str, Any]],
                                                           dockerfile: DockerfileParser) -> None:
    assert json.loads(instructions(dockerfile, "ENTRYPOINT")[-1]) == ["jetroll"]
    assert set(built) >= {"controller", "rollout", "reward", "celery-worker", "trainer", "env"}
    jetroll = [str(BIN / "jetroll")] if (BIN / "jetroll").exists() else JETROLL
    for name, svc in built.items():
        assert "entrypoint" not in svc, f"{name} must keep the image's ENTRYPOINT jetroll"
        command = svc["command"]
        assert isinstance(command, list) and command, f"{name}: command must be an exec-form list"
        build_parser().parse_args(command)  # strict: bad or missing arguments exit 2 here
        result = subprocess.run([*jetroll, *command, "--help"], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert result.returncode == 0, f"{name}: jetroll {' '.join(command)} --help\n{result.stderr}"


def test_watch_services_write_the_heartbeat_their_healthcheck_reads(built: dict[str, dict[str, Any]]) -> None:
    for name, svc in built.items():
        test = " ".join(svc["healthcheck"]["test"])
        if "heartbeat" not in test:
            continue
        path = svc["environment"]["JETROLL_HEARTBEAT_FILE"]
        assert path in test and "--watch" in svc["command"], name
    celery = built["celery-worker"]
    assert "jetroll.functions.celery_app" in " ".join(celery["healthcheck"]["test"])
    assert celery["environment"]["JETROLL_CELERY_BROKER_URL"] == celery["environment"]["JETROLL_REDIS_URL"]


def test_depends_on_targets_exist_with_valid_conditions(services: dict[str, dict[str, Any]]) -> None:
    graph: dict[str, set[str]] = {}
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        if isinstance(deps, list):
            deps = {target: {"condition": "service_started"} for target in deps}
        graph[name] = set(deps)
        for target, spec in deps.items():
            assert target in services and target != name, f"{name} depends on unknown service {target!r}"
            condition = spec.get("condition", "service_started")
            assert condition in CONDITIONS, f"{name} -> {target}: condition {condition!r}"
            if condition == "service_healthy":
                check = services[target].get("healthcheck")
                assert check and not check.get("disable") and check.get("test"), f"{target} has no healthcheck"
            if condition == "service_completed_successfully":  # a one-shot: restarting would never complete
                assert services[target].get("restart", "no") == "no", f"{target} must not restart"

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
        for target in graph[name]:
            visit(target, (*path, name))

    for name in graph:
        visit(name, ())
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    controller = services["controller"]["depends_on"]
    assert controller["redis"]["condition"] == "service_healthy"
    assert controller["minio-init"]["condition"] == "service_completed_successfully"


def host_port(spec: str | int | dict[str, Any]) -> str | None:
    """The published host port of a port mapping; None when Docker picks one."""
    if isinstance(spec, dict):
        published = spec.get("published")
        return interpolate(str(published)) if published is not None else None
    parts = interpolate(str(spec)).split("/")[0].rsplit(":", 2)
    return parts[-2] if len(parts) >= 2 else None


def test_images_and_ports_are_consistent(services: dict[str, dict[str, Any]],
                                         built: dict[str, dict[str, Any]]) -> None:
    # one tag per variant of the Dockerfile: jetroll:latest (CPU) for every service, jetroll:gpu for the vLLM pool
    tags = {svc["image"]: svc["build"].get("args", {}).get("TORCH_VARIANT") for svc in built.values()}
    assert tags == {"jetroll:latest": "${JETROLL_TORCH_VARIANT:-cpu}", "jetroll:gpu": "gpu"}, tags
    assert [name for name, svc in built.items() if svc["image"] == "jetroll:gpu"] == ["rollout-vllm"]
    vllm = built["rollout-vllm"]
    assert vllm["profiles"] == ["vllm"] and vllm["command"][-2:] == ["--pool", "vllm"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name, svc in built.items():
        build = svc["build"]
        assert build["context"] == "." and build.get("dockerfile", "Dockerfile") == "Dockerfile", name
        assert "container_name" not in svc, f"{name}: a fixed container_name blocks --scale"
    for name, svc in services.items():
        if name not in built:
            assert ":" in svc["image"], f"{name}: name the image's tag"
    published: dict[str, str] = {}
    for name, svc in services.items():
        for spec in svc.get("ports", []):
            port = host_port(spec)
            if port is None:
                continue
            assert port not in published, f"{name} and {published[port]} both publish host port {port}"
            published[port] = name
    assert {"redis", "minio"} <= set(published.values())
    assert "ports" not in services["rollout"], "rollout is scaled: no replica may claim a host port"
    assert services["redis"]["command"] == ["redis-server", "--appendonly", "yes"]  # AOF: queued jobs survive


def test_the_stacks_job_config_fits_the_stack(compose: dict[str, Any], built: dict[str, dict[str, Any]]) -> None:
    config = load_config(REPO / "configs" / "compose.yaml")
    assert config.model == load_config(REPO / "configs" / "arithmetic.yaml").model  # the default job's base, shared
    env = built["controller"]["environment"]
    assert config.store.type == "s3" and config.store.endpoint_url == env["AWS_ENDPOINT_URL"]
    bucket, _ = config.store.bucket_and_prefix
    assert f"local/{bucket}" in " ".join(compose["services"]["minio-init"]["command"])
    assert config.redis.url == env["JETROLL_REDIS_URL"]
    assert config.reward.backend == "celery" and "celery-worker" in built
    mounts = {volume.split(":")[1] for volume in built["controller"]["volumes"]}
    runs_dir = built["controller"]["command"][built["controller"]["command"].index("--runs-dir") + 1]
    assert runs_dir in mounts
    assert config.model.cache_dir.replace("~", "/home/jetroll") in mounts  # the image user's model cache, shared
    assert {v.split(":")[0] for v in built["controller"]["volumes"]} <= set(compose["volumes"])


def test_dockerfile_installs_the_project_as_a_non_root_user(dockerfile: DockerfileParser) -> None:
    runs = instructions(dockerfile, "RUN")
    installs = [run for run in runs if re.search(r"pip install\b[^;&|]*\s\"?\.(\[[\w,-]+\])?\"?(\s|;|$)", run)]
    assert installs, f"no RUN installs the project with `pip install .`: {runs}"
    copied = " ".join(instructions(dockerfile, "COPY"))
    for path in ("pyproject.toml", "setup.py", "shared/", "services/", "functions/", "configs/"):
        assert path in copied, f"the image lacks {path}"
    users = instructions(dockerfile, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert json.loads(instructions(dockerfile, "ENTRYPOINT")[-1]) == ["jetroll"]
    assert dockerfile.baseimage == "python:3.11-slim"


def test_dockerfile_has_a_gpu_variant_and_pyprojects_torch(dockerfile: DockerfileParser) -> None:
    args = dict(value.split("=", 1) for value in instructions(dockerfile, "ARG") if "=" in value)
    assert args.get("TORCH_VARIANT") == "cpu" and "BASE_IMAGE" in args
    install = next(run for run in instructions(dockerfile, "RUN") if "TORCH_VARIANT" in run)
    assert "download.pytorch.org/whl/cpu" in install and '".[gpu,agents]"' in install and '".[agents]"' in install
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"torch=={args['TORCH_VERSION']}" in project["dependencies"]
    named = {extra for run in instructions(dockerfile, "RUN") for group in re.findall(r"\.\[([\w,-]+)\]", run)
             for extra in group.split(",")}
    assert {"gpu", "agents"} <= named  # the env service runs agents: the openai client and the gateway's server
    assert named <= set(project["optional-dependencies"]), named - set(project["optional-dependencies"])
    assert any(pin.startswith("vllm==0.32.") for pin in project["optional-dependencies"]["gpu"])


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv*", "runs/"} <= ignored
    assert not ignored & {"shared/", "services/", "functions/", "configs/", "pyproject.toml", "README.md"}
