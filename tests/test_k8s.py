"""deploy/ (Kubernetes, kustomize base + cpu/gpu overlays) validated offline: every manifest
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), the overlays rendered by
`kubectl kustomize` when kubectl is installed (else their files and patch targets checked),
and the invariants the services rely on: gRPC health probes on the ports the workers serve,
grace periods above the drain timeouts, PDBs and Services that select real pods, and every
flag a manifest passes known to the CLI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
K8S_VERSIONS = ("1.29.0", "1.33.0")  # oldest and newer clusters this targets (grpc probes: 1.27+)
HEALTH_SERVICES = {"router": "pdserve.v1.Router", "prefill-worker": "pdserve.v1.PrefillWorker",
                   "decode-worker": "pdserve.v1.DecodeWorker"}


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def _base_docs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in _kustomization(DEPLOY / "base")["resources"]:
        out += _docs((DEPLOY / "base" / name).read_text())
    return out


def _render(overlay: str) -> list[dict[str, Any]]:
    proc = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return _docs(proc.stdout)


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl (with its built-in kustomize) not installed")


def _validate(doc: dict[str, Any], version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, version, strict=True)


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("directory", ["base", "overlays/cpu", "overlays/gpu"])
def test_kustomizations_reference_existing_files(directory: str) -> None:
    here = DEPLOY / directory
    k = _kustomization(here)
    assert k["kind"] == "Kustomization"
    for res in k.get("resources", []):
        assert (here / res).exists(), (directory, res)
    for patch in k.get("patches", []):
        assert (here / patch["path"]).is_file(), (directory, patch)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_base_manifests_validate(version: str) -> None:
    docs = _base_docs()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "Secret",
                                         "PodDisruptionBudget"}
    for doc in docs:
        _validate(doc, version)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_patches_fit_the_base(overlay: str) -> None:
    """Without rendering: strategic patches name containers the base has, JSON 6902 patches
    append to an args list that exists."""
    here = DEPLOY / "overlays" / overlay
    base = {d["metadata"]["name"]: d for d in _base_docs() if d["kind"] == "Deployment"}
    for patch in _kustomization(here)["patches"]:
        body = yaml.safe_load((here / patch["path"]).read_text())
        targets = [d for name, d in base.items()
                   if name in ("pdserve-prefill", "pdserve-decode")]
        assert patch["target"]["kind"] == "Deployment" and targets
        for target in targets:
            containers = target["spec"]["template"]["spec"]["containers"]
            if isinstance(body, list):  # JSON 6902
                for op in body:
                    assert op["op"] == "add"
                    assert op["path"] == "/spec/template/spec/containers/0/args/-"
                    assert isinstance(containers[0]["args"], list)
            else:
                names = {c["name"] for c in body["spec"]["template"]["spec"]["containers"]}
                assert names <= {c["name"] for c in containers}, (overlay, names)


# --------------------------------------------------------------------------- rendered


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlays_validate(overlay: str) -> None:
    docs = _render(overlay)
    for doc in docs:
        for version in K8S_VERSIONS:
            _validate(doc, version)


def _flag(argv: list[str], flag: str) -> str | None:
    """The last value of `flag` (argparse semantics: the last one wins)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else None


def _check_topology(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    by_kind = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert set(deployments) == {"pdserve-redis", "pdserve-router", "pdserve-prefill",
                                "pdserve-decode"}
    parser = build_parser()
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        if name == "pdserve-redis":
            continue
        spec = pod["spec"]
        (container,) = spec["containers"]
        args = container["args"]
        assert args[0] == "pdserve" and args[1] in HEALTH_SERVICES, name
        parser.parse_args(args[1:])  # every flag is one the CLI knows, with a valid value
        port = int(_flag(args, "--port") or 0)
        assert container["readinessProbe"]["grpc"] == {"port": port,
                                                       "service": HEALTH_SERVICES[args[1]]}
        assert container["startupProbe"]["grpc"]["port"] == port
        assert "grpc" not in container["livenessProbe"], name  # draining is not dead
        drain = float(_flag(args, "--drain-timeout") or 0)
        assert drain > 0 and spec["terminationGracePeriodSeconds"] > drain, name
        assert container["resources"]["requests"]["cpu"], name
        assert spec["securityContext"]["runAsUser"] == 10001  # the image's user
        for src in container["envFrom"]:
            ref = src.get("configMapRef") or src.get("secretRef")
            kind = "ConfigMap" if "configMapRef" in src else "Secret"
            assert (kind, ref["name"]) in by_kind, ref
        if args[1] != "router":
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["PDSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == \
                "status.podIP"
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for component in ("router", "prefill", "decode"):
        assert any(p["spec"]["selector"]["matchLabels"] ==
                   deployments[f"pdserve-{component}"]["spec"]["selector"]["matchLabels"]
                   for p in pdbs), component
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <=
                   d["spec"]["template"]["metadata"]["labels"].items()
                   for d in deployments.values()), svc["metadata"]["name"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["PDSERVE_REDIS_URL"].startswith("redis://pdserve-redis:")
    return deployments


def test_base_topology() -> None:
    _check_topology(_base_docs())


@needs_kubectl
def test_cpu_overlay_sizes_threads_to_the_pod() -> None:
    deployments = _check_topology(_render("cpu"))
    for name in ("pdserve-prefill", "pdserve-decode"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert _flag(c["args"], "--threads") == str(c["resources"]["limits"]["cpu"])


@needs_kubectl
def test_gpu_overlay_runs_workers_on_cuda() -> None:
    deployments = _check_topology(_render("gpu"))
    for name in ("pdserve-prefill", "pdserve-decode"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "pdserve:cuda"
        assert _flag(c["args"], "--device") == "cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (router,) = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"]
    assert router["image"] == "pdserve:latest"
