"""spec.model: what model a service serves, where its weights come from and where they are cached."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule
from .common import DNS_SUBDOMAIN, QUANTITY, SERVED_NAME_FORBIDDEN, SERVED_NAME_MESSAGE, SecretKeyRef


class HuggingFaceSource(Model, frozen=True, kw_only=True):
    """Load the weights from the Hugging Face Hub by id (spec.model.name)."""
    revision: Optional[Annotated[str, Meta(
        description="Git revision (branch, tag or commit) of the model repository: vLLM loads "
                    "the weights and the tokenizer at it (--revision, --tokenizer-revision) and "
                    "the guard counts tokens with the tokenizer at it. A commit hash pins the "
                    "model; a branch follows it at each pod start. Unset: the default branch.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]] = None
    credentials_secret_ref: Optional[Annotated[SecretKeyRef, Meta(
        description="Secret holding a Hugging Face token for gated models, exposed as HF_TOKEN to the "
                    "model-fetch init container that downloads the weights, and to no container that "
                    "listens (vLLM and the guard read the download offline). Never put a token inline.")]] = None
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
