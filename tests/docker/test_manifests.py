"""docker/k8s and docker/kserve: every document checked against its API, and the pieces against each other
and against a real sixfold-serve started with the manifests' own arguments."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from kubernetes.client import ApiClient

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import ServerConfig
from sixfold.server.cli import _parser
from sixfold.server.workers.process import ReadyProcess
from tests.conftest import free_port, triton_inputs
from tests.docker import k8s_strict
from tests.docker.conftest import SMALL_ROWS, Pod, deployment_container, start_like_the_pod
from tests.docker.manifests import DOCKER, DRAIN_PHASES, Dockerfile, container_ports, documents, only, serve_command

SCHEMAS = Path(__file__).parent / "schemas"
K8S, KSERVE = documents("k8s"), documents("kserve")
OPTIONAL_EXTRAS = {"prometheus-adapter-rules.yaml", "servicemonitor.yaml"}
"""docker/k8s files deliberately left out of kustomization.yaml (they need other components; docs/deploy.md)."""


def _schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def _kserve_validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_schema(kind.lower()))


def _deployment() -> dict:
    return only(K8S, "Deployment", "sixfold")


def _pod_spec() -> dict:
    return _deployment()["spec"]["template"]["spec"]


def _runtime() -> dict:
    return only(KSERVE, "ServingRuntime", "sixfold")


def _isvcs() -> list[dict]:
    return [d for _, d in KSERVE if d["kind"] == "InferenceService"]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


# --- every document is checked by something -------------------------------------------------------------

def test_every_document_has_a_checker():
    core = {("apps/v1", "Deployment"), ("v1", "Service"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ("policy/v1", "PodDisruptionBudget"), ("v1", "ConfigMap")}
    seen = {(d["apiVersion"], d["kind"]) for _, d in K8S}
    assert seen - core == {("kustomize.config.k8s.io/v1beta1", "Kustomization"),
                           ("monitoring.coreos.com/v1", "ServiceMonitor")}, seen
    assert core <= seen
    assert {(d["apiVersion"], d["kind"]) for _, d in KSERVE} == {
        ("serving.kserve.io/v1alpha1", "ServingRuntime"), ("serving.kserve.io/v1beta1", "InferenceService")}


def _ids(docs: list[tuple[Path, dict]]) -> list[str]:
    return [f"{path.name}:{doc['kind']}/{doc.get('metadata', {}).get('name')}" for path, doc in docs]


CORE = [(p, d) for p, d in K8S if d["apiVersion"].split("/")[0] in ("v1", "apps", "autoscaling", "policy")]


@pytest.mark.parametrize("path,doc", CORE, ids=_ids(CORE))
def test_core_objects_are_exactly_kubernetes_api_objects(path, doc):
    loaded = k8s_strict.load(doc)  # raises naming any field the API does not have
    assert loaded.metadata.name == doc["metadata"]["name"]
    assert type(loaded).__name__ == k8s_strict.model_name(doc["apiVersion"], doc["kind"])


def test_the_strict_check_catches_what_the_client_lets_through():
    bad = copy.deepcopy(_deployment())
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    pod = bad["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    # The client's own deserializer takes both silently: the probe and the grace are just gone.
    silent = ApiClient()._ApiClient__deserialize(bad, "V1Deployment")
    assert silent.spec.template.spec.containers[0].readiness_probe is None
    assert silent.spec.template.spec.termination_grace_period_seconds is None
    container["ports"][0]["containerPort"] = "8000"
    with pytest.raises(ValueError) as caught:
        k8s_strict.load(bad)
    message = str(caught.value)
    assert ".spec.template.spec.containers[0].readinesProbe: not a field of V1Container" in message
    assert ".spec.template.spec.containers[0].ports[0].containerPort: expected int, got str '8000'" in message
    assert ".spec.template.spec.terminationGracePeriod: not a field of V1PodSpec" in message
    hpa = copy.deepcopy(only(K8S, "HorizontalPodAutoscaler"))
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = "1"
    assert k8s_strict.unknown_fields(hpa, "V2HorizontalPodAutoscaler") == [
        ".spec.metrics[0].pods.target.averageValu: not a field of V2MetricTarget "
        "(it has: averageUtilization, averageValue, type, value)"]


def test_the_api_models_own_checks_run_too():
    missing = copy.deepcopy(_deployment())
    del missing["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        k8s_strict.load(missing)


# --- KServe: the CRD-derived schemas ---------------------------------------------------------------------

def test_the_schemas_name_the_kserve_commit_they_come_from():
    for name in ("servingruntime", "inferenceservice"):
        description = _schema(name)["description"]
        assert "kserve/kserve config/crd/full/serving.kserve.io_" in description
        commit = description.split("at commit ")[1].split(".")[0]
        assert len(commit) == 40 and int(commit, 16) >= 0


@pytest.mark.parametrize("path,doc", KSERVE, ids=_ids(KSERVE))
def test_kserve_objects_match_the_crd(path, doc):
    errors = sorted(e.message for e in _kserve_validator(doc["kind"]).iter_errors(doc))
    assert errors == [], f"{path.name}: {errors}"


def test_the_kserve_schemas_reject_misspelt_and_mistyped_fields():
    isvc = copy.deepcopy(_isvcs()[0])
    model = isvc["spec"]["predictor"]["model"]
    model["protocolVersoin"] = model.pop("protocolVersion")
    model["modelFormat"]["nmae"] = "sixfold"
    errors = [e.message for e in _kserve_validator("InferenceService").iter_errors(isvc)]
    assert any("'protocolVersoin' was unexpected" in e for e in errors), errors
    assert any("'nmae' was unexpected" in e for e in errors), errors
    runtime = copy.deepcopy(_runtime())
    runtime["spec"]["containers"][0]["readinesProbe"] = {}
    runtime["spec"]["supportedModelFormats"][0]["priority"] = 0
    errors = [e.message for e in _kserve_validator("ServingRuntime").iter_errors(runtime)]
    assert any("'readinesProbe' was unexpected" in e for e in errors), errors
    assert any("0 is less than the minimum of 1" in e for e in errors), errors


def test_the_runtime_container_is_exactly_a_kubernetes_container():
    for container in _runtime()["spec"]["containers"]:
        assert k8s_strict.unknown_fields(container, "V1Container") == []
    for isvc in _isvcs():
        for port in isvc["spec"]["predictor"]["model"].get("ports", []):
            assert k8s_strict.unknown_fields(port, "V1ContainerPort") == []


# --- the pieces agree with each other ----------------------------------------------------------------------

def test_kustomization_lists_the_manifests():
    kustomization = only(K8S, "Kustomization")
    listed = set(kustomization["resources"])
    assert all((DOCKER / "k8s" / name).is_file() for name in listed), listed
    on_disk = {p.name for p in (DOCKER / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk - listed == OPTIONAL_EXTRAS
    assert [i["name"] for i in kustomization["images"]] == [deployment_container()["image"].split(":")[0]]


def test_probes_and_services_name_real_container_ports():
    container = deployment_container()
    named = container_ports(container)
    assert named == {"http": 8000, "grpc": 8001, "metrics": 8002}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        action = container[probe].get("httpGet") or container[probe].get("grpc")
        assert action["port"] in named or action["port"] in named.values(), (probe, action)
    pod_labels = _deployment()["spec"]["template"]["metadata"]["labels"]
    assert _deployment()["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for _, service in [(p, d) for p, d in K8S if d["kind"] == "Service"]:
        assert service["spec"]["selector"].items() <= pod_labels.items(), service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, port
            assert port["name"] == port["targetPort"]
        grpc = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc and grpc[0]["appProtocol"] == "grpc"
    assert only(K8S, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = only(K8S, "ServiceMonitor")
    service = only(K8S, "Service", "sixfold")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    annotations = _deployment()["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == named["metrics"]


def test_the_hpa_scales_the_deployment_on_a_series_the_adapter_serves():
    hpa = only(K8S, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", _deployment()["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2, "one replica cannot drain without dropping to zero"
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    rules = yaml.safe_load(only(K8S, "ConfigMap", "prometheus-adapter-sixfold-rules")["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    assert metric["pods"]["metric"]["name"] in served
    for rule in rules:
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_termination_grace_covers_prestop_and_the_whole_drain():
    spec = _pod_spec()
    sleep = deployment_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = ServerConfig().grace_seconds
    assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + grace
    # the bound the comment in deployment.yaml derives: every drain phase may take the whole grace
    drain = _parser().parse_args(deployment_container()["args"]).drain_seconds
    assert spec["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain + DRAIN_PHASES * grace
    strategy = _deployment()["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_resources_give_the_benchmarked_cpus_and_guaranteed_qos():
    for resources in (deployment_container()["resources"], _runtime()["spec"]["containers"][0]["resources"]):
        assert resources["requests"] == resources["limits"]
        assert resources["requests"]["cpu"] == "2"  # BENCHMARKS.md's latency-bounded host: 2 CPUs


def probe_mismatches(container: dict, serve_args: list[str]) -> list[str]:
    """Where a container's HTTP probes disagree with the sixfold-serve they probe: the port they name is
    not its --http-port (or REST is off), or their scheme is not HTTPS exactly when it has --tls-cert."""
    args = _parser().parse_args(serve_args)
    named = container_ports(container)
    out = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        action = container.get(probe, {}).get("httpGet")
        if action is None:
            continue
        port = named.get(action["port"], action["port"])
        if args.http_port < 1 or port != args.http_port:
            out.append(f"{probe}: port {action['port']} is not --http-port {args.http_port}")
        scheme = action.get("scheme", "HTTP")
        if scheme != ("HTTPS" if args.tls_cert else "HTTP"):
            out.append(f"{probe}: scheme {scheme} but the server {'has' if args.tls_cert else 'has no'} --tls-cert")
    return out


def test_probes_follow_the_servers_port_and_tls():
    container = deployment_container()
    argv = Dockerfile.read().exec_form("ENTRYPOINT")[1:] + container["args"]
    assert probe_mismatches(container, argv) == []
    # KServe's runtime declares no probes (KServe adds its own on the port it routes): nothing to disagree
    [runtime] = _runtime()["spec"]["containers"]
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(runtime)
    # the check catches a TLS server probed over plain HTTP, and a moved REST port
    tls = argv + ["--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
    assert len(probe_mismatches(container, tls)) == 3
    https = copy.deepcopy(container)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        https[probe]["httpGet"]["scheme"] = "HTTPS"
    assert probe_mismatches(https, tls) == []
    assert len(probe_mismatches(container, argv + ["--http-port", "9000"])) == 3
    assert len(probe_mismatches(container, argv + ["--http-port", "-1"])) == 3


def test_deployment_args_are_sixfold_serve_args():
    container = deployment_container()
    entrypoint = Dockerfile.read().exec_form("ENTRYPOINT")
    assert "command" not in container, "the pod runs the image's ENTRYPOINT"
    args = _parser().parse_args(entrypoint[1:] + container["args"])
    ports = container_ports(container)
    assert (args.http_port, args.grpc_port, args.metrics_port) == (ports["http"], ports["grpc"], ports["metrics"])
    assert args.host == "0.0.0.0" and args.model in models.names()


def test_kserve_runtime_args_are_sixfold_serve_args_and_follow_kserve_ports():
    runtime = _runtime()
    [container] = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["command"] == ["sixfold-serve"]
    assert "ports" not in container, "KServe merges the InferenceService's one routed port into this container"
    args = _parser().parse_args(container["args"])
    assert args.model_repository == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert args.model_control_mode == "explicit" and args.load_model == ["{{.Name}}"]
    assert args.http_port == 8080  # KServe's default HTTP port: a REST InferenceService declares none
    assert int(runtime["spec"]["annotations"]["prometheus.kserve.io/port"]) == args.metrics_port
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}
    for isvc in _isvcs():
        model = isvc["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        ports = model.get("ports", [])
        if model["protocolVersion"] == "grpc-v2":
            assert [(p["name"], p["containerPort"]) for p in ports] == [("h2c", args.grpc_port)]
        else:
            assert ports == []
    assert {m["spec"]["predictor"]["model"]["protocolVersion"] for m in _isvcs()} == {"v2", "grpc-v2"}


# --- the manifests against a real server -------------------------------------------------------------------

def _infer_once(url: str, model: str, rows: int) -> np.ndarray:
    request = models.RequestGenerator.for_config(models.get_config(model, max_rows=rows), seed=5).make(3)
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.infer(model, triton_inputs(grpcclient, request)).as_numpy("scores")
    finally:
        client.close()


def test_probe_paths_answer_on_the_ports_they_name(pod: Pod):
    container = deployment_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        action = container[probe]["httpGet"]
        assert _get(f"http://127.0.0.1:{pod.ports[action['port']]}{action['path']}") == 200, probe


def test_the_hpa_metric_and_the_adapter_series_are_exported(pod: Pod):
    args = _parser().parse_args(deployment_container()["args"])
    assert _infer_once(f"127.0.0.1:{pod.ports['grpc']}", args.model, int(SMALL_ROWS)).shape == (3, 1)
    with urllib.request.urlopen(f"http://127.0.0.1:{pod.ports['metrics']}/metrics", timeout=5) as response:
        page = response.read().decode()
    hpa_metric = only(K8S, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert f'{hpa_metric}{{model="{args.model}",version="1"}}' in page
    assert f"# TYPE {hpa_metric} gauge" in page
    rules = yaml.safe_load(only(K8S, "ConfigMap", "prometheus-adapter-sixfold-rules")["data"]["config.yaml"])["rules"]
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert f"\n{series}{{" in page, series


def test_sigterm_drains_well_inside_the_termination_grace():
    started = start_like_the_pod()
    try:
        assert started.proc.url, started.proc.output
        assert _get(f"http://127.0.0.1:{started.ports['http']}/v2/health/ready") == 200
        t0 = time.monotonic()
        started.proc.proc.send_signal(signal.SIGTERM)
        code = started.proc.proc.wait(timeout=60)
        drained_s = time.monotonic() - t0
    finally:
        started.proc.kill()
    assert code == 0, started.proc.output
    prestop = int(deployment_container()["lifecycle"]["preStop"]["exec"]["command"][1])
    assert prestop + drained_s < _pod_spec()["terminationGracePeriodSeconds"], drained_s
    assert "shutting down (answering queued requests)" in started.proc.output


@pytest.fixture(scope="module")
def kserve_store(tmp_path_factory):
    """/mnt/models as KServe's storage initializer leaves it: a sixfold repository with a folder per model,
    named like the InferenceService."""
    [name] = {isvc["metadata"]["name"] for isvc in _isvcs()}
    root = tmp_path_factory.mktemp("mnt-models")
    _, partitioned = partition_builtin(name, max_rows=500, seed=0, cards=2)
    write_artifacts(partitioned, root / name / "1")
    return root, name


def _runtime_command(store: Path, isvc_name: str, ports: dict[int, int]) -> list[str]:
    """The runtime container's command as KServe runs it: {{.Name}} filled from the InferenceService."""
    [container] = _runtime()["spec"]["containers"]
    words = [w.replace("{{.Name}}", isvc_name).replace("/mnt/models", str(store))
             for w in container["command"] + container["args"]]
    assert not [w for w in words if "{{" in w], words
    command = serve_command(words[:1], words[1:], ports)
    command[0] = str(Path(sys.executable).parent / command[0])
    return command


def _secret_env() -> dict[str, str]:
    """The environment KServe gives the container: the control token from the Secret the runtime names."""
    [container] = _runtime()["spec"]["containers"]
    [ref] = [e for e in container["env"] if e["name"] == "SIXFOLD_CONTROL_TOKEN"]
    assert not ref["valueFrom"]["secretKeyRef"].get("optional"), "without the Secret the server must not start"
    return {**os.environ, "SIXFOLD_CONTROL_TOKEN": "from-the-secret"}


def test_the_kserve_runtime_without_its_secret_refuses_to_start(kserve_store):
    store, name = kserve_store
    args = _parser().parse_args(_runtime()["spec"]["containers"][0]["args"])
    local = {p: free_port() for p in (args.http_port, args.grpc_port, args.metrics_port)}
    env = {k: v for k, v in os.environ.items() if k != "SIXFOLD_CONTROL_TOKEN"}
    proc = ReadyProcess(_runtime_command(store, name, local), env=env, timeout_s=180)
    try:
        assert not proc.url
        assert proc.proc.wait(timeout=30) == 2
    finally:
        proc.kill()
    assert "--insecure-model-control" in proc.output


def test_the_kserve_runtime_serves_the_inferenceservice_model(kserve_store):
    store, name = kserve_store
    args = _parser().parse_args(_runtime()["spec"]["containers"][0]["args"])
    local = {args.http_port: free_port(), args.grpc_port: free_port(), args.metrics_port: free_port()}
    proc = ReadyProcess(_runtime_command(store, name, local), env=_secret_env(), timeout_s=180)
    try:
        assert proc.url, proc.output
        http = local[args.http_port]
        assert _get(f"http://127.0.0.1:{http}/v2/health/ready") == 200
        assert _get(f"http://127.0.0.1:{http}/v2/models/{name}/ready") == 200
        assert _infer_once(f"127.0.0.1:{local[args.grpc_port]}", name, 500).shape == (3, 1)
    finally:
        assert proc.stop() == 0, proc.output


def test_the_kserve_runtime_refuses_a_name_not_in_the_store(kserve_store):
    store, name = kserve_store
    args = _parser().parse_args(_runtime()["spec"]["containers"][0]["args"])
    local = {p: free_port() for p in (args.http_port, args.grpc_port, args.metrics_port)}
    proc = ReadyProcess(_runtime_command(store, "other-model", local), env=_secret_env(), timeout_s=180)
    try:
        assert not proc.url
        assert proc.proc.wait(timeout=30) == 2
    finally:
        proc.kill()
    assert f"--load-model ['other-model']: not in {store} (it has ['{name}'])" in proc.output


# --- sizing: the worked example in docs/deploy.md ----------------------------------------------------------

def test_the_sizing_example_in_the_docs_adds_up():
    text = (DOCKER.parent / "docs" / "deploy.md").read_text()
    per_pod, target, headroom, replicas = 11.91, 500, 0.7, 60
    assert math.ceil(target / (per_pod * headroom)) == replicas
    for figure in ("11.91", "2026-11-23", f"ceil({target} / ({per_pod} × {headroom}))", f"= {replicas}"):
        assert figure in text, figure
    assert "11.91" in (DOCKER.parent / "BENCHMARKS.md").read_text()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_renders_exactly_the_listed_objects():
    rendered = subprocess.run(["kubectl", "kustomize", str(DOCKER / "k8s")], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    docs = list(yaml.safe_load_all(rendered))
    listed = {(d["kind"], d["metadata"]["name"]) for p, d in K8S
              if p.name in only(K8S, "Kustomization")["resources"]}
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == listed
    for doc in docs:
        k8s_strict.load(doc)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "sixfold:latest"
