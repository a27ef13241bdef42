"""The deployment files name only what the code has: settings, ports, routes, modules, volumes, and
the Grafana dashboard only metrics the code exports."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import api.metrics  # noqa: F401 - registers the API's families
import workers.metrics  # noqa: F401 - registers the workers' families
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "runwarden.json"
# Section 12's families, and the dashboard's subjects (issue 14).
CONTRACT_FAMILIES = {"runwarden_tool_calls_total", "runwarden_tool_call_duration_seconds", "runwarden_queue_wait_seconds",
                     "runwarden_streams_open", "runwarden_stream_bytes_total", "runwarden_idempotency_total",
                     "runwarden_sandbox_failures_total", "runwarden_quota_refusals_total"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> list[dict[str, Any]]:
    """The Kubernetes objects (the kustomization is kustomize's file, not an object)."""
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml" for doc in documents(path)]


def pod_specs() -> list[dict[str, Any]]:
    return [doc["spec"]["template"]["spec"] for doc in k8s_objects() if doc["kind"] == "Deployment"]


def settings_variables() -> set[str]:
    """Every environment variable shared/settings.py reads (the only reader of the environment)."""
    source = (ROOT / "shared" / "settings.py").read_text()
    return set(re.findall(r'"((?:RUNWARDEN|PROMETHEUS)_[A-Z_]+)"', source))


def test_every_yaml_parses_and_every_kubernetes_object_is_whole() -> None:
    paths = sorted(DEPLOY.rglob("*.yaml"))
    assert {p.name for p in paths} >= {"compose.yaml", "api.yaml", "worker.yaml", "hpa.yaml", "kustomization.yaml"}
    for path in paths:
        assert documents(path), path
    for doc in k8s_objects():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    kustomized = set(documents(K8S / "kustomization.yaml")[0]["resources"])
    assert kustomized <= {p.name for p in K8S.glob("*.yaml")} and "hpa.yaml" in kustomized


def test_every_runwarden_variable_named_is_a_real_setting() -> None:
    """Also the commented ones: an operator uncomments them."""
    known = settings_variables()
    for path in [*DEPLOY.rglob("*.yaml"), DEPLOY / "env.example", DEPLOY / "Dockerfile"]:
        named = set(re.findall(r"\b((?:RUNWARDEN|PROMETHEUS)_[A-Z_]+[A-Z])\b", path.read_text()))
        assert named <= known, (path.name, named - known)
    assert {"RUNWARDEN_WORKER_METRICS_PORT", "PROMETHEUS_MULTIPROC_DIR", "RUNWARDEN_LOG_FORMAT"} <= known


def test_images_commands_and_ports_match_the_code() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    api_port = int(re.search(r'"--bind", "0\.0\.0\.0:(\d+)"', dockerfile).group(1))  # type: ignore[union-attr]
    assert f"EXPOSE {api_port}" in dockerfile and "api.app:create_app()" in dockerfile
    [image] = documents(K8S / "kustomization.yaml")[0]["images"]
    default_worker_port = Settings.from_env({"RUNWARDEN_REDIS_URL": "redis://h"}, require_jwt=False).worker_metrics_port
    for spec in pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["image"] in (image["name"], "redis:7"), container["image"]
            args = container.get("args", [])
            if "celery" in args:
                assert args[args.index("-A") + 1] == "workers.worker" and (ROOT / "workers" / "worker.py").exists()
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for port in container.get("ports", []):
                if port["name"] == "http":
                    assert port["containerPort"] == api_port
                if port["name"] == "metrics":
                    assert port["containerPort"] == int(env["RUNWARDEN_WORKER_METRICS_PORT"]) == default_worker_port
    compose = documents(DEPLOY / "compose.yaml")[0]["services"]
    assert compose["api"]["ports"] == [f"{api_port}:{api_port}"]
    assert compose["worker"]["expose"] == [str(default_worker_port)]
    assert compose["worker"]["deploy"]["replicas"] == 2 and "flower" in compose["flower"]["command"]
    assert "--appendonly" in compose["redis"]["command"]
    assert compose["redis"]["command"][compose["redis"]["command"].index("--appendonly") + 1] == "yes"


def test_probes_name_real_routes_and_services_real_ports(stack) -> None:  # type: ignore[no-untyped-def]
    from api.app import create_app

    routes = {rule.rule for rule in create_app(Settings.from_env(stack.env)).url_map.iter_rules()}
    probed = 0
    for spec in pod_specs():
        for container in spec["containers"]:
            names = {p["name"] for p in container.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                check = container.get(probe, {})
                if "httpGet" in check:
                    assert check["httpGet"]["path"] in routes and check["httpGet"]["port"] in names
                    probed += 1
                if "tcpSocket" in check:
                    assert check["tcpSocket"]["port"] in names
    assert probed >= 2
    for service in (doc for doc in k8s_objects() if doc["kind"] == "Service"):
        [deployment] = [d for d in k8s_objects() if d["kind"] == "Deployment"
                        and d["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]]
        ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_volumes_mounted_are_declared_and_settings_paths_are_mounted() -> None:
    config = next(doc for doc in k8s_objects() if doc["kind"] == "ConfigMap")["data"]
    for spec in pod_specs():
        declared = {v["name"] for v in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
            assert set(mounts) <= declared, (container["name"], set(mounts) - declared)
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if "PROMETHEUS_MULTIPROC_DIR" in env:  # the metrics directory is a volume of its own
                assert env["PROMETHEUS_MULTIPROC_DIR"] in mounts.values()
            if container["name"] in ("worker", "sandbox-check"):
                assert config["RUNWARDEN_WORKSPACES"] in mounts.values()
    compose = documents(DEPLOY / "compose.yaml")[0]
    for name in ("api", "worker"):
        service = compose["services"][name]
        assert "/run/runwarden-metrics" in service["tmpfs"]
    assert {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])
            if not v.startswith(".")} <= set(compose["volumes"])


def test_autoscalers_target_the_deployments_on_cpu_they_request() -> None:
    deployments = {d["metadata"]["name"]: d for d in k8s_objects() if d["kind"] == "Deployment"}
    hpas = [doc for doc in k8s_objects() if doc["kind"] == "HorizontalPodAutoscaler"]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"runwarden-api", "runwarden-worker"}
    for hpa in hpas:
        assert hpa["apiVersion"] == "autoscaling/v2" and 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        target = deployments[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"]  # the autoscaler owns them
        [metric] = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu"  # utilization is of the request: there must be one
        for container in target["spec"]["template"]["spec"]["containers"]:
            assert container["resources"]["requests"]["cpu"]


def test_docker_compose_accepts_the_file() -> None:
    """`docker compose config` (or the standalone `docker-compose`) needs no daemon."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        command = ["docker-compose"]
    else:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    env = {**os.environ, "REDIS_PASSWORD": "x" * 32, "RUNWARDEN_JWT_SECRET": "y" * 48}
    done = subprocess.run([*command, "-f", str(DEPLOY / "compose.yaml"), "config"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=DEPLOY)  # docker-compose 1 reads the seccomp file from here
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert set(resolved) == {"redis", "api", "worker", "flower"}
    assert resolved["worker"]["environment"]["PROMETHEUS_MULTIPROC_DIR"] == "/run/runwarden-metrics"


# --- the dashboard -------------------------------------------------------------------------------

def exported_series() -> set[str]:
    """The sample names the code's registered families produce."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("runwarden_"):
            names.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return names


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(runwarden_[a-z_]+)\b", expr))


def test_dashboard_is_a_grafana_dashboard_model() -> None:
    model = json.loads(DASHBOARD.read_text())
    assert isinstance(model["title"], str) and model["uid"] and isinstance(model["schemaVersion"], int)
    assert [v["type"] for v in model["templating"]["list"]] == ["datasource"]
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids)) >= 8
    for panel in model["panels"]:
        assert panel["type"] in {"timeseries", "stat", "gauge", "bargauge", "table"} and panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"] and all(t["refId"] and t["expr"] for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"


def test_every_dashboard_query_names_metrics_the_code_exports() -> None:
    exported = exported_series()
    used = set()
    for expr in dashboard_queries():
        names = metric_names(expr)
        assert names and names <= exported, (expr, names - exported)
        used |= names
    bases = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert CONTRACT_FAMILIES <= bases | used, CONTRACT_FAMILIES - bases - used
