"""docker-compose.yml: its structure is checked here (no Docker engine on CI); a Docker run skips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .servers import docker_available

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_services_are_all_there() -> None:
    services = compose()["services"]
    assert {"mongo", "redis", "worker1", "worker2", "beat1", "beat2", "demo"} <= set(services)


def test_mongo_is_a_replica_set_initiated_by_its_healthcheck() -> None:
    mongo = compose()["services"]["mongo"]
    assert "--replSet" in mongo["command"]
    check = " ".join(mongo["healthcheck"]["test"])
    assert "rs.initiate" in check and "mongo:27017" in check


def test_app_services_point_at_the_replica_set_and_the_broker() -> None:
    services = compose()["services"]
    for name in ("worker1", "worker2", "beat1", "beat2", "demo"):
        env = services[name]["environment"]
        assert (
            env["EMAILGROUPS_MONGO_URL"].startswith("mongodb://mongo:27017/")
            and "replicaSet=rs0" in env["EMAILGROUPS_MONGO_URL"]
        )
        assert env["EMAILGROUPS_BROKER_URL"] == "redis://redis:6379/0"
        assert services[name]["depends_on"]["mongo"]["condition"] == "service_healthy"
        assert "uploads:/uploads" in services[name]["volumes"]
    for beat in ("beat1", "beat2"):
        assert "celery_mongolock.beat:Scheduler" in services[beat]["command"]
    demo = services["demo"]["command"]
    assert "--external" in demo and "--upload-dir" in demo
    assert (ROOT / "example_project" / demo[1]).exists()


def test_the_image_builds_from_files_that_exist() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src


def test_docker_compose_up() -> None:
    ok, why = docker_available()
    if not ok:
        pytest.skip(f"Docker-based test: {why}")
    import subprocess

    out = subprocess.run(
        ["docker", "compose", "up", "--build", "--abort-on-container-exit", "--exit-code-from", "demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    subprocess.run(["docker", "compose", "down", "-v"], cwd=ROOT, capture_output=True, check=False)
    assert out.returncode == 0, out.stdout[-3000:]
