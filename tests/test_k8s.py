"""deploy/ (Kubernetes, kustomize base + cpu/gpu overlays) validated offline: every manifest
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), the overlays rendered by
`kubectl kustomize` when kubectl is installed (else their files and patch targets checked),
and the invariants the services rely on: gRPC health probes on the ports the workers serve,
grace periods above the drain timeouts, PDBs and Services that select real pods, and every
flag a manifest passes known to the CLI.

Fail closed (issue 21): the Secrets are required and not shipped (re-applying never resets
one, a pod without one does not start), nothing secret sits in a ConfigMap, every pod passes
the "restricted" Pod Security Standard (checked here rule by rule), NetworkPolicies let only
the router and prefill pods reach workers and only pdserve pods reach Redis, every container
has resource requests and limits, every image is pinned, and the Redis command of the
manifest, run here, wants its password."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
K8S_VERSIONS = ("1.29.0", "1.33.0")  # oldest and newer clusters this targets (grpc probes: 1.27+)
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
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
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "NetworkPolicy"}
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
        secrets = set()
        for src in container["envFrom"]:
            if "configMapRef" in src:
                assert ("ConfigMap", src["configMapRef"]["name"]) in by_kind, src
            else:  # required, and created out of band (never shipped, never reset)
                secrets.add(src["secretRef"]["name"])
                assert not src["secretRef"].get("optional"), (name, src)
        assert "pdserve-cluster-secret" in secrets, name
        assert ("pdserve-api-keys" in secrets) == (args[1] == "router"), name
        env = {e["name"]: e for e in container.get("env", [])}
        url = env["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
        assert url == {"name": "pdserve-redis", "key": "url"}, name
        assert "--redis-url" not in args and "--insecure" not in args, name
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
    assert not [d for d in docs if d["kind"] == "Secret"], "a Secret is shipped"
    for config in (d for d in docs if d["kind"] == "ConfigMap"):
        for key, value in config["data"].items():
            assert not any(w in key.upper() for w in ("URL", "KEY", "SECRET", "PASSWORD",
                                                      "TOKEN")), key
            assert "@" not in value and "://" not in value, (key, value)
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
        assert c["image"] == f"pdserve:{VERSION}-cuda"
        assert _flag(c["args"], "--device") == "cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (router,) = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"]
    assert router["image"] == f"pdserve:{VERSION}"


# --------------------------------------------------------------------------- fail closed


def _all_docs() -> dict[str, list[dict[str, Any]]]:
    out = {"base": _base_docs()}
    if shutil.which("kubectl") is not None:
        out.update({overlay: _render(overlay) for overlay in OVERLAYS})
    return out


# The "restricted" Pod Security Standard (Kubernetes 1.25+), both levels: baseline's rules
# and restricted's own. https://kubernetes.io/docs/concepts/security/pod-security-standards/
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What keeps a pod spec from the "restricted" Pod Security Standard ([] when it
    passes): the rules the admission controller's `restricted` level enforces."""
    bad: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [*pod.get("initContainers", []), *pod["containers"],
                  *pod.get("ephemeralContainers", [])]
    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{field}: true")
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if "hostPath" in kinds:
            bad.append(f"hostPath volume {vol['name']}")
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"volume {vol['name']} of type {sorted(kinds)}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"unsafe sysctl {sysctl['name']}")
    pod_user_ok = psc.get("runAsUser", 1) != 0
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        bad.append("pod seccompProfile Unconfined")
    if (psc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
        bad.append("pod seLinuxOptions.type")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        bad.append("pod appArmorProfile Unconfined")
    for c in containers:
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort {port['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if (sc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
            bad.append(f"{name}: seLinuxOptions.type")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append(f"{name}: appArmorProfile Unconfined")
        caps = sc.get("capabilities") or {}
        if not set(caps.get("add", [])) <= BASELINE_CAPABILITIES:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        if not (sc.get("runAsNonRoot") is True or
                (pod_nonroot and sc.get("runAsNonRoot") is not False)):
            bad.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", 1) == 0 or not pod_user_ok:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp!r}")
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities do not drop ALL")
        if not set(caps.get("add", [])) <= {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities beyond NET_BIND_SERVICE")
    return bad


def test_the_pod_security_check_catches_violations() -> None:
    """The checker itself: a compliant pod passes, each common violation is named."""
    good: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        "volumes": [{"name": "tmp", "emptyDir": {}}]}
    assert restricted_violations(good) == []

    def broken(path: str, value: Any) -> list[str]:
        import copy

        pod = copy.deepcopy(good)
        *parents, leaf = path.split(".")
        node = pod
        for key in parents:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
        return restricted_violations(pod)

    c = "containers.0.securityContext"
    for path, value in [("securityContext.runAsNonRoot", None),
                        ("securityContext.runAsUser", 0),
                        ("securityContext.seccompProfile", None),
                        ("securityContext.seccompProfile.type", "Unconfined"),
                        (f"{c}.allowPrivilegeEscalation", None),
                        (f"{c}.capabilities.drop", ["NET_RAW"]),
                        (f"{c}.capabilities.add", ["SYS_ADMIN"]),
                        (f"{c}.privileged", True),
                        ("hostNetwork", True),
                        ("volumes", [{"name": "h", "hostPath": {"path": "/"}}])]:
        assert broken(path, value), (path, value)


def test_every_pod_passes_the_restricted_pod_security_standard() -> None:
    for where, docs in _all_docs().items():
        for dep in (d for d in docs if d["kind"] == "Deployment"):
            spec = dep["spec"]["template"]["spec"]
            assert restricted_violations(spec) == [], (where, dep["metadata"]["name"])
            assert spec.get("automountServiceAccountToken") is False, dep["metadata"]["name"]


def test_every_container_has_requests_and_limits() -> None:
    for where, docs in _all_docs().items():
        for dep in (d for d in docs if d["kind"] == "Deployment"):
            for c in dep["spec"]["template"]["spec"]["containers"]:
                res = c["resources"]
                for kind in ("requests", "limits"):
                    assert res[kind].get("cpu") and res[kind].get("memory"), \
                        (where, dep["metadata"]["name"], kind)


def test_every_image_is_pinned() -> None:
    for where, docs in _all_docs().items():
        for dep in (d for d in docs if d["kind"] == "Deployment"):
            for c in dep["spec"]["template"]["spec"]["containers"]:
                image = c["image"]
                name, _, tag = image.rpartition("@")[0].rpartition(":") if "@" in image \
                    else image.rpartition(":")
                assert name and tag and tag != "latest", (where, image)
                assert any(ch.isdigit() for ch in tag), (where, image)  # a version
                if name.endswith("pdserve"):
                    assert tag.split("-")[0] == VERSION, (where, image)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr.get("values", []):
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
    return True


def _may_connect(policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str],
                 port: str | None, same_namespace: bool = True) -> bool:
    """Whether NetworkPolicy ingress lets a pod labelled `src` reach `dst` on named `port`
    (None: any port)."""
    applying = [p for p in policies if _selects(p["spec"]["podSelector"], dst)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = [str(p["port"]) for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for peer in rule.get("from", []):
                if "ipBlock" in peer:
                    continue
                if "namespaceSelector" not in peer and not same_namespace:
                    continue
                if _selects(peer.get("podSelector", {}), src):
                    return True
    return False


def test_network_policies() -> None:
    for where, docs in _all_docs().items():
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                for d in docs if d["kind"] == "Deployment"}
        stranger = {"app.kubernetes.io/name": "something-else"}
        prometheus = {"app.kubernetes.io/name": "prometheus"}
        router, prefill, decode, redis = (pods[f"pdserve-{n}"]
                                          for n in ("router", "prefill", "decode", "redis"))
        for worker in (prefill, decode):
            for port in (None, "grpc", "metrics"):  # None: UCX, a port the worker picks
                assert _may_connect(policies, router, worker, port), where
                assert _may_connect(policies, prefill, worker, port), where
                assert not _may_connect(policies, stranger, worker, port), (where, port)
                assert not _may_connect(policies, redis, worker, port), (where, port)
            assert not _may_connect(policies, decode, worker, "grpc"), where
            assert _may_connect(policies, prometheus, worker, "metrics", same_namespace=False)
            assert not _may_connect(policies, prometheus, worker, "grpc", same_namespace=False)
        for client in (router, prefill, decode):
            assert _may_connect(policies, client, redis, "redis"), where
        for outsider in (stranger, prometheus):
            assert not _may_connect(policies, outsider, redis, "redis"), where
        assert _may_connect(policies, stranger, router, "http"), where  # the API is public


def _free_port() -> int:
    return free_port()  # below the ephemeral range (pdserve.cluster.free_port)


def _redis_says(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command)
        return s.recv(256)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_redis_manifest_wants_its_password(tmp_path: Path) -> None:
    """The Redis container's command, run here (its /tmp a private directory, a free port on
    loopback): with the Secret's password it serves only clients that send it; without
    one it refuses to start."""
    (dep,) = [d for d in _base_docs() if d["kind"] == "Deployment"
              and d["metadata"]["name"] == "pdserve-redis"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["sh", "-c"] and "requirepass" in c["args"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env["REDISCLI_AUTH"] == {"name": "pdserve-redis", "key": "password"}
    port = _free_port()
    script = (c["args"][0].replace("/tmp/", f"{tmp_path}/")
              + f" --port {port} --bind 127.0.0.1")
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                             env={k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"})
    assert refused.returncode != 0 and "no Redis password" in refused.stderr
    password = "k8s-redis-test-password-0123456789"
    proc = subprocess.Popen(["sh", "-c", script], env={**os.environ, "REDISCLI_AUTH": password},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                answer = _redis_says(port, b"PING\r\n")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert answer.startswith(b"-NOAUTH"), answer
        assert _redis_says(port, f"AUTH {password}\r\nPING\r\n".encode()).startswith(b"+OK")
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        # the readiness probe, with the password in its environment as in the pod
        probe = c["readinessProbe"]["exec"]["command"]
        ok = subprocess.run([*probe[:-1], probe[-1].replace("redis-cli", f"redis-cli -p {port}")],
                            env={**os.environ, "REDISCLI_AUTH": password}, timeout=10)
        assert ok.returncode == 0
        bad = subprocess.run([*probe[:-1], probe[-1].replace("redis-cli", f"redis-cli -p {port}")],
                             env={**os.environ, "REDISCLI_AUTH": "wrong"}, timeout=10,
                             capture_output=True)
        assert bad.returncode != 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
