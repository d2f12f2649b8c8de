"""Pure builders: InferenceService → the child objects the operator applies.

Each returns a complete object for server-side apply (apiVersion, kind,
metadata with owner reference, spec), so applying it twice is a no-op and a
hand edit to a field we manage is put back.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from gpufleet_api.guard import demand_prior, gpu_memory
from gpufleet_api.guard.control_auth import ADMIN_SOCKET_DIR, ControlAuthConfig
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_api.guard.engine_flags import CPU_REQUEST_ENV
from gpufleet_api.guard.guard_config import GuardConfig, Role
from gpufleet_api.v1alpha1 import InferenceServiceSpec, VolumeMount

from . import guard_config, kv_transfer, lora, model_cache, names, placement, pools, revision

CONFIG_DIR = "/etc/gpufleet"
ADMIN_VOLUME = "guard-admin"
ADMIN_MOUNT = {"name": ADMIN_VOLUME, "mountPath": ADMIN_SOCKET_DIR}
DRAIN_SLACK_SECONDS = 30
# Both containers run as this unprivileged user (the guard's and vLLM's files are world-readable
# in the image; every path they write is an emptyDir). docs/security.md says why each setting.
RUN_AS_USER = 65532
CACHE_DIR = "/cache"


def pod_security_context() -> dict:
    # The restricted Pod Security Standard asks a seccomp profile of every pod.
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "capabilities": {"drop": ["ALL"]}}


def engine_runtime_env() -> list[dict]:
    """Where vLLM writes on a read-only root: its own, Triton's, torch's and CUDA's caches go under
    $HOME and $XDG_CACHE_HOME (the cache emptyDir), temporary files and IPC sockets under /tmp (an
    emptyDir). USER: the image has no passwd entry for RUN_AS_USER, and torch asks getpass for a name."""
    return [{"name": "HOME", "value": CACHE_DIR}, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
            {"name": "USER", "value": "gpufleet"}]


def _meta(isvc: dict, name: str, extra_labels: dict | None = None) -> dict:
    service = isvc["metadata"]["name"]
    labels = names.common_labels(service)
    labels.update(extra_labels or {})
    return {"name": name, "namespace": isvc["metadata"]["namespace"], "labels": labels,
            "ownerReferences": [names.owner_reference(isvc)]}


def build_configmap(isvc: dict, spec: InferenceServiceSpec, draining: Iterable[Role] = (), *,
                    stable_running: GuardConfig | None = None,
                    canary: bool = False, allow_private_sources: bool = False,
                    control_auth: ControlAuthConfig | None = None,
                    otlp_endpoint: str = "") -> tuple[dict, dict[Role, str]]:
    """The guard ConfigMap and, per pool, the hash of its restart fields (rolls that pool's pods
    when it changes). One key per pool (``names.guard_config_key``: guard.json for the unified pool,
    guard-prefill.json and guard-decode.json for a disaggregated service's), each pod reading its
    own: the live fields reach every running guard through the one ConfigMap, and demand.json
    lies beside them all. ``draining``: roles of a shape the service left whose pods still run;
    their key stays (a running guard takes only its live fields from it, and its preStop hook
    reads its drain timeout there) until they are gone.

    A canary (spec.rollout Canary, a unified service): ``canary`` adds ``names.CANARY_CONFIG_KEY``
    with the new revision's guard.json for the canary's pods, and ``stable_running`` (the guard.json
    the stable's pods run, from the live ConfigMap) keeps the stable's restart fields in guard.json
    while the spec's live fields still reach it. The hash is the spec's, whichever is written.
    ``allow_private_sources``: the operator's --adapter-private-sources (guard.json's
    adapters.allowPrivateSources, a live field). ``control_auth``: who the guards' control routes
    accept (guard.json's controlAuth, a live field: a rotated key reaches running guards).
    ``otlp_endpoint``: the fleet's OTLP receiver, into guard.json's tracing (docs/tracing.md)."""
    meta = isvc["metadata"]
    data, hashes = {}, {}
    for pool in pools.pools(spec):
        config = guard_config.build_guard_config(meta["name"], meta["namespace"], pool.spec, pool.role,
                                                 allow_private_sources=allow_private_sources,
                                                 control_auth=control_auth, otlp_endpoint=otlp_endpoint)
        data[names.guard_config_key(pool.role)] = guard_config.render(config)
        # Only what a restart applies is hashed: admission changes reach the running guards live.
        hashes[pool.role] = guard_config.config_hash(config)
        if pool.role == "unified" and canary:
            data[names.CANARY_CONFIG_KEY] = guard_config.render(config)
        if pool.role == "unified" and stable_running is not None:
            data[names.guard_config_key(pool.role)] = guard_config.render(
                guard_config.keep_restart_fields(stable_running, config))
    for role in sorted(set(draining) - set(hashes)):
        data[names.guard_config_key(role)] = guard_config.render(
            guard_config.build_guard_config(meta["name"], meta["namespace"], spec, role,
                                            allow_private_sources=allow_private_sources,
                                            control_auth=control_auth, otlp_endpoint=otlp_endpoint))
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(isvc, names.configmap_name(meta["name"])),
          "data": data}
    return cm, hashes


DEMAND_FIELD_MANAGER = "gpufleet-demand"


def build_demand_prior(isvc: dict, prior: demand_prior.DemandPrior) -> dict:
    """The ``demand.json`` key of the guard ConfigMap alone, applied by its own field manager
    (``DEMAND_FIELD_MANAGER``) beside the reconciler's ``guard.json``: observed, not spec. It
    changes no pod template; a guard reads it when it starts (contract/demand_prior.py)."""
    meta = isvc["metadata"]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": names.configmap_name(meta["name"]), "namespace": meta["namespace"],
                         "ownerReferences": [names.owner_reference(isvc)]},
            "data": {demand_prior.FILE_NAME: json.dumps(demand_prior.to_document(prior), sort_keys=True)}}


def _model_volume(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, engine volumeMounts, env) for the weight source. The env is for the containers that
    fetch from the Hub: model-fetch, and vLLM when no model-fetch ran before it (``hub_token_env``
    says which get the token); never the guard."""
    src = spec.model.source
    volumes, mounts, env = [], [], []
    if src.pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": guard_config.MODEL_MOUNT, "readOnly": True})
    hf = src.hugging_face
    if hf and hf.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hf.endpoint})
    return volumes, mounts, env


def hub_token_env(spec: InferenceServiceSpec) -> list[dict]:
    """HF_TOKEN from spec.model.source.huggingFace.credentialsSecretRef, for the containers that fetch
    from the Hub and only them: model-fetch downloads the weights; vLLM and the guard then read the
    cache offline (HF_HUB_OFFLINE=1), so neither needs it. The guard listens on the pod network and
    takes adapter sources from callers: it never gets the token (a Hub adapter downloads anonymously)."""
    hf = spec.model.source.hugging_face
    if not (hf and hf.credentials_secret_ref):
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": hf.credentials_secret_ref.name, "key": hf.credentials_secret_ref.key}}}]


def _volume_mount(m: VolumeMount) -> dict:
    mount = {"name": m.name, "mountPath": m.mount_path, "readOnly": m.read_only}
    if m.sub_path:
        mount["subPath"] = m.sub_path
    return mount


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    return spec.admission.request_timeout_seconds + DRAIN_SLACK_SECONDS


def _allocator_env(spec: InferenceServiceSpec, role: Role) -> list[dict]:
    """PYTORCH_CUDA_ALLOC_CONF from spec.engine.cudaAllocatorConfig (expandable segments unless set, or
    unless the pool runs a KV connector: kv_transfer.allocator_config)."""
    conf = kv_transfer.allocator_config(spec, role)
    return [{"name": gpu_memory.ALLOCATOR_ENV, "value": conf}] if conf else []


def build_deployment(isvc: dict, spec: InferenceServiceSpec, replicas: int, config_hash: str,
                     role: Role = "unified", track: str | None = None) -> dict:
    """The Deployment of one pool (``pools.pools``: ``spec`` carries that pool's resources).

    Its pods carry ``names.LABEL_REVISION``: the hash of the template without that label
    (``manifests.revision``). ``track`` "canary": the unified pool's canary (``<service>-canary``,
    selector plus ``gpufleet.dev/track: canary``, reading ``names.CANARY_CONFIG_KEY``), labelled with
    the revision the stable Deployment would have with the same spec, so the two compare equal once
    the stable is promoted."""
    dep = _deployment(isvc, spec, replicas, config_hash, role, names.guard_config_key(role))
    rev = revision.of_template(dep["spec"]["template"])
    if track == names.TRACK_CANARY:
        service = isvc["metadata"]["name"]
        dep = _deployment(isvc, spec, replicas, config_hash, role, names.CANARY_CONFIG_KEY)
        dep["metadata"]["name"] = names.canary_deployment_name(service)
        dep["metadata"]["labels"][names.LABEL_TRACK] = names.TRACK_CANARY
        dep["spec"]["selector"] = {"matchLabels": names.canary_labels(service)}
        dep["spec"]["template"]["metadata"]["labels"][names.LABEL_TRACK] = names.TRACK_CANARY
    dep["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION] = rev
    return dep


def _deployment(isvc: dict, spec: InferenceServiceSpec, replicas: int, config_hash: str,
                role: Role, config_key: str) -> dict:
    service = isvc["metadata"]["name"]
    model_label = names.model_label(spec.model.name)
    pod = spec.pod
    pod_labels = {**pod.labels, **names.common_labels(service), **names.pool_labels(service, role),
                  names.LABEL_MODEL: model_label, names.LABEL_ISOLATION: spec.isolation.mode}
    gpus = placement.gpu_resources(spec)
    res = spec.resources
    model_volumes, model_mounts, model_env = _model_volume(spec)
    config_mount = {"name": "guard-config", "mountPath": CONFIG_DIR, "readOnly": True}
    config_arg = f"{CONFIG_DIR}/{config_key}"
    drain = {"exec": {"command": ["gpufleet-engine", "drain-wait", "--config", config_arg]}}
    engine = {
        "name": "vllm",
        "image": spec.engine.image,
        "command": ["gpufleet-engine", "vllm", "--config", config_arg],
        # No port: vLLM listens on the pod's loopback (guard.json's engine.host); the guard is the way in.
        "env": [{"name": "HF_HOME", "value": model_cache.HF_HOME}, *engine_runtime_env(), *model_env,
                *model_cache.offline_env(spec),
                # vLLM-CPU sizes its threads to the request (whole cores, rounded up): see cpu_budget.py.
                {"name": CPU_REQUEST_ENV, "valueFrom": {"resourceFieldRef": {
                    "resource": "requests.cpu", "divisor": "1"}}},
                # The token only where vLLM itself may reach the Hub: no model-fetch ran before it.
                *(() if model_cache.downloads(spec) else hub_token_env(spec)),
                *_allocator_env(spec, role), {"name": gpu_memory.ENV_DIR, "value": gpu_memory.MOUNT_PATH},
                *kv_transfer.env(spec, role), *lora.env(spec)],
        "resources": {"requests": {"cpu": str(res.cpu), "memory": str(res.memory), **gpus,
                                   **model_cache.requests(spec)},
                      "limits": {"memory": str(res.memory), **gpus}},
        "volumeMounts": [config_mount, {"name": "cache", "mountPath": CACHE_DIR},
                         *model_cache.mounts(spec, read_only=True),
                         {"name": "engine-tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts, ADMIN_MOUNT,
                         {"name": gpu_memory.VOLUME, "mountPath": gpu_memory.MOUNT_PATH},
                         *kv_transfer.mounts(spec, role), *lora.mounts(spec, writes=False),
                         *(_volume_mount(m) for m in pod.volume_mounts)],
        # vLLM must outlive the guard's drain, or in-flight requests die with it.
        "lifecycle": {"preStop": drain},
        "securityContext": container_security_context(),
    }
    guard = {
        "name": "guard",
        "image": spec.engine.image,
        "command": ["gpufleet-engine", "serve", "--config", config_arg],
        "ports": [{"name": "http", "containerPort": names.GUARD_PORT}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        # The guard counts tokens with the model's own tokenizer: it reads the same weights
        # location (and Hugging Face cache) as the engine, read-only. Never the Hub token
        # (hub_token_env): the guard is the pod's network-facing container.
        # No GPU: it requests none, and NVIDIA's runtime must not show it the node's (an image built
        # on CUDA's sets NVIDIA_VISIBLE_DEVICES=all). GPU memory comes from vLLM's plugin's reports.
        "env": [{"name": "HF_HOME", "value": model_cache.HF_HOME}, *model_env, *model_cache.offline_env(spec),
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                {"name": gpu_memory.ENV_DIR, "value": gpu_memory.MOUNT_PATH}, *lora.env(spec)],
        # The root filesystem is read-only; loading a tokenizer needs a temporary directory.
        "volumeMounts": [config_mount, {"name": "cache", "mountPath": "/cache", "readOnly": True},
                         *model_cache.mounts(spec, read_only=True),
                         {"name": "guard-tmp", "mountPath": "/tmp"}, *model_mounts, ADMIN_MOUNT,
                         {"name": gpu_memory.VOLUME, "mountPath": gpu_memory.MOUNT_PATH, "readOnly": True},
                         *kv_transfer.guard_mounts(spec, role), *lora.mounts(spec, writes=True)],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2,
                           "failureThreshold": 2, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3, "timeoutSeconds": 5},
        # Model download and load can take many minutes; liveness waits for it.
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5,
                         "failureThreshold": 360},
        "lifecycle": {"preStop": drain},
        "securityContext": container_security_context(),
    }
    pod_spec = {
        "containers": [engine, guard],
        # Hub weights are downloaded (into the cache, once per cache) before vLLM starts.
        **({"initContainers": [{
            "name": model_cache.FETCH_CONTAINER, "image": spec.engine.image,
            "command": ["gpufleet-engine", "fetch-model", "--config", config_arg],
            "env": [{"name": "HF_HOME", "value": model_cache.HF_HOME}, *engine_runtime_env(), *model_env,
                    *hub_token_env(spec)],
            # A download waits on the network, not the CPU; the pod's request is the larger of this
            # and its containers' sum, so more here would only keep replicas off a node.
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
            "volumeMounts": [config_mount, {"name": "cache", "mountPath": CACHE_DIR},
                             *model_cache.mounts(spec, read_only=False), {"name": "engine-tmp", "mountPath": "/tmp"}],
            "securityContext": container_security_context(),
            # The error it prints (gated repo, bad revision) becomes the status message.
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }]} if model_cache.downloads(spec) else {}),
        "securityContext": {**pod_security_context(), **model_cache.pod_security(spec, RUN_AS_USER),
                            **kv_transfer.pod_security(spec, role, RUN_AS_USER)},
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "nodeSelector": placement.node_selector(spec),
        "tolerations": placement.tolerations(spec),
        "volumes": [
            {"name": "guard-config", "configMap": {"name": names.configmap_name(service)}},
            {"name": "cache", "emptyDir": model_cache.emptydir(spec)},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            {"name": "guard-tmp", "emptyDir": {"sizeLimit": "256Mi"}},
            # The guard's admin socket (POST /drain from both containers' preStop hooks): in the pod only.
            {"name": ADMIN_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": "engine-tmp", "emptyDir": {}},
            {"name": gpu_memory.VOLUME, "emptyDir": {"sizeLimit": "16Mi"}},
            *model_volumes,
            *model_cache.volumes(service, spec),
            *kv_transfer.volumes(service, spec, role),
            *lora.volumes(spec),
            *pod.volumes,
        ],
        "enableServiceLinks": False,
        # No container of an engine pod calls the Kubernetes API (the guard, vLLM and model-fetch talk
        # to each other, the Hub and the operator's HTTP calls only): a token mounted here would be one
        # more credential for whoever gets code running in the pod.
        "automountServiceAccountToken": False,
    }
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": r.name} for r in pod.image_pull_secrets]
    if pod.priority_class_name:
        pod_spec["priorityClassName"] = pod.priority_class_name
    aff = placement.affinity(spec, service)
    if aff:
        pod_spec["affinity"] = aff
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(isvc, names.deployment_name(service, role)),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.pool_labels(service, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": pod_labels,
                             "annotations": {**pod.annotations, names.ANNOTATION_CONFIG_HASH: config_hash}},
                "spec": pod_spec,
            },
        },
    }


def build_service(isvc: dict) -> dict:
    service = isvc["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(isvc, names.service_name(service)),
        "spec": {"type": "ClusterIP", "selector": names.selector_labels(service),
                 "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]},
    }


def pdb_selector(service: str, role: Role = "unified") -> dict:
    """The pods a pool's budget counts: its Deployment's. The unified pool's selector (the service's own
    labels) would also match a disaggregated pool's pods and a canary's, and a pod under two budgets
    cannot be evicted at all: it leaves out any pod with a role, and canary pods (their Deployment's
    replicas are not this pool's, so they must not count toward its minAvailable)."""
    selector: dict = {"matchLabels": names.pool_labels(service, role)}
    if role == "unified":
        selector["matchExpressions"] = [{"key": names.LABEL_ROLE, "operator": "DoesNotExist"},
                                        {"key": names.LABEL_TRACK, "operator": "NotIn", "values": ["canary"]}]
    return selector


def build_pdb(isvc: dict, role: Role = "unified", replicas: int = 1) -> dict:
    """A pool's PodDisruptionBudget (docs/drains.md). ``replicas``: the pool's desired replicas, without
    the drain surge (``reconcile.drains``). minAvailable = those: an eviction (``kubectl drain``) is
    allowed only while a surge replica is Ready, so the pool never serves on fewer replicas than it
    wants. A replica that is not Ready is not protected (unhealthyPodEvictionPolicy AlwaysAllow): a
    broken or still-loading replica never blocks a drain."""
    service = isvc["metadata"]["name"]
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(isvc, names.pdb_name(service, role)),
        "spec": {"minAvailable": replicas, "selector": pdb_selector(service, role),
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }


def _prometheus_name(label: str) -> str:
    """A pod label as Kubernetes service discovery names it (``__meta_kubernetes_pod_label_<name>``)."""
    return label.replace(".", "_").replace("/", "_").replace("-", "_")


def build_podmonitor(isvc: dict, spec: InferenceServiceSpec, labels: Mapping[str, str] | None = None) -> dict:
    """``labels``: the operator's own (--podmonitor-label); the spec's podMonitorLabels win over them.
    Our own labels win over both: the operator finds its children by them."""
    service = isvc["metadata"]["name"]
    # Each engine series says which service it serves and, on a disaggregated service's pods, which
    # pool (role="prefill" or "decode"; a pod without the label gets none), so dashboards split by role.
    relabel = [{"sourceLabels": [f"__meta_kubernetes_pod_label_{_prometheus_name(label)}"], "targetLabel": target}
               for label, target in ((names.LABEL_SERVICE, "service"), (names.LABEL_ROLE, "role"))]
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": _meta(isvc, names.podmonitor_name(service),
                          {**(labels or {}), **spec.monitoring.pod_monitor_labels, **names.common_labels(service)}),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(service)},
            "podMetricsEndpoints": [
                {"port": "http", "path": GUARD_METRICS_PATH, "interval": "15s", "relabelings": relabel},
                # vLLM's own metrics, through the guard; endpoint="vllm" keeps its series (process_*
                # and python_* too) apart from the guard's, as when vLLM had a port of its own.
                {"port": "http", "path": ENGINE_METRICS_PATH, "interval": "15s",
                 "relabelings": [*relabel, {"targetLabel": "endpoint", "replacement": "vllm"}]},
            ],
        },
    }
