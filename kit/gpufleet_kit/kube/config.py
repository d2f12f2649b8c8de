"""Where the Kubernetes API is and how to authenticate to it.

The ``kubernetes`` package's loaders do the reading, so everything kubectl
accepts works: merged ``$KUBECONFIG`` lists, client certificates, tokens and
token files, inline ``*-data``, exec credential plugins (how EKS, GKE and AKS
kubeconfigs log in), OIDC and GCP auth providers, and the in-cluster
service-account mount. What they load becomes an immutable ``Credentials``
snapshot that the async client sends with each request.

Credentials go stale: exec tokens carry an expiry, projected service-account
tokens rotate in their file, and any token can be refused (401). ``KubeConfig``
reloads its source then. Loading may run a plugin (a subprocess, an identity
provider round trip), so it blocks: async callers reload with
``asyncio.to_thread``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import ssl
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from .errors import KubeError

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"

# Reload a token this long before its source says it expires (clock skew, a request in flight).
EXPIRY_MARGIN = datetime.timedelta(seconds=10)
# Token files (projected service-account tokens) are rotated in place: re-read them this often.
TOKEN_FILE_REREAD_SECONDS = 60.0
# Never reload more often than this: a plugin handing out expired or refused tokens is not run per request.
MIN_RELOAD_SECONDS = 5.0


class KubeConfigError(KubeError):
    """The kubeconfig or in-cluster credentials are missing or unusable."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One loaded set of connection settings and credentials."""
    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    authorization: str | None = None    # the Authorization header: "Bearer <token>", "Basic <...>"
    insecure: bool = False
    tls_server_name: str | None = None
    proxy: str | None = None
    namespace: str = "default"
    expires_at: datetime.datetime | None = None  # when the token stops working, where its source says
    renew_at: datetime.datetime | None = None    # when to replace it: a margin before it expires
    reload_at: float | None = None      # time.monotonic() after which to load them again
    loaded_at: float = dataclasses.field(default_factory=time.monotonic)
    generation: int = 0                 # counts reloads; a refused generation is reloaded once

    @property
    def scheme(self) -> str | None:
        return self.authorization.split(" ", 1)[0] if self.authorization else None

    @property
    def token(self) -> str | None:
        if not self.authorization:
            return None
        parts = self.authorization.split(" ", 1)
        return parts[1].strip() if len(parts) == 2 else parts[0]

    def stale(self, now: float | None = None) -> bool:
        return self.reload_at is not None and (time.monotonic() if now is None else now) >= self.reload_at

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    @property
    def tls_identity(self) -> tuple:
        """What the TLS connection is built from: a change needs a new connection pool."""
        return (self.server, self.ca_file, self.cert_file, self.key_file, self.insecure, self.proxy)


class KubeConfig:
    """A source of credentials (a kubeconfig or the pod's service account) and
    the ones loaded from it last. Thread-safe: reloads are serialised."""

    def __init__(self, load: Callable[[], Credentials], source: str):
        self.source = source
        self._load = load
        self._lock = threading.Lock()
        self._current = load()

    @property
    def current(self) -> Credentials:
        return self._current

    def reload(self, *, unless_newer_than: int | None = None) -> Credentials:
        """Load the credentials again (blocking: may run a credential plugin).
        With ``unless_newer_than``, skip the reload when another caller already
        replaced that generation."""
        with self._lock:
            if unless_newer_than is not None and self._current.generation > unless_newer_than:
                return self._current
            fresh = self._load()
            self._current = dataclasses.replace(fresh, generation=self._current.generation + 1)
            return self._current

    def refresh_if_stale(self) -> Credentials:
        creds = self._current
        return self.reload(unless_newer_than=creds.generation) if creds.stale() else creds

    def reload_refused(self, refused: Credentials) -> Credentials | None:
        """New credentials after the API server refused ``refused`` (401), or
        None when a reload cannot help (they were loaded moments ago)."""
        if self._current.generation > refused.generation:
            return self._current
        if time.monotonic() - refused.loaded_at < MIN_RELOAD_SECONDS:
            return None
        return self.reload(unless_newer_than=refused.generation)

    # The fields of the current credentials, for callers that only need where the API is.
    @property
    def server(self) -> str:
        return self._current.server

    @property
    def ca_file(self) -> str | None:
        return self._current.ca_file

    @property
    def cert_file(self) -> str | None:
        return self._current.cert_file

    @property
    def key_file(self) -> str | None:
        return self._current.key_file

    @property
    def insecure(self) -> bool:
        return self._current.insecure

    @property
    def namespace(self) -> str:
        return self._current.namespace

    def __repr__(self) -> str:
        return f"KubeConfig({self.source}, server={self.server})"

    # --- sources -------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike, context: str | None = None) -> "KubeConfig":
        """A kubeconfig file, or a list of them joined with ``os.pathsep`` (merged as kubectl does:
        the first file to define a name wins)."""
        paths = [Path(p).expanduser() for p in str(path).split(os.pathsep) if p]
        if not paths:
            raise KubeConfigError("no kubeconfig path given")
        label = os.pathsep.join(str(p) for p in paths)
        return cls(lambda: _load_kubeconfig(paths, context, label), f"kubeconfig {label}")

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None,
                   directory: str | os.PathLike | None = None) -> "KubeConfig":
        """The pod's service account: $KUBERNETES_SERVICE_HOST/PORT and the mounted token and CA."""
        environ = os.environ if environ is None else environ
        directory = IN_CLUSTER_DIR if directory is None else directory
        if not environ.get("KUBERNETES_SERVICE_HOST") or not (Path(directory) / "token").exists():
            raise KubeConfigError("not running inside a Kubernetes pod")
        return cls(lambda: _load_in_cluster(environ, Path(directory)), f"in-cluster service account {directory}")

    @classmethod
    def auto(cls, kubeconfig: str | None = None, context: str | None = None) -> "KubeConfig":
        """Explicit path (or path list), then $KUBECONFIG, then in-cluster, then ~/.kube/config."""
        if kubeconfig:
            return cls.from_file(kubeconfig, context)
        env = os.environ.get("KUBECONFIG")
        if env:
            return cls.from_file(env, context)
        try:
            return cls.in_cluster()
        except KubeConfigError:
            return cls.from_file(DEFAULT_KUBECONFIG, context)


def _load_kubeconfig(paths: list[Path], context: str | None, label: str) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

    existing = [str(p) for p in paths if p.is_file()]
    if not existing:
        raise KubeConfigError(f"kubeconfig {label} does not exist")
    conf = Configuration()
    try:
        merged = KubeConfigMerger(os.pathsep.join(existing))
        if merged.config is None:
            raise KubeConfigError(f"kubeconfig {label} is empty")
        # kubectl takes current-context from the first file that sets one; the merger takes the last.
        firsts = [merged.config_files[p].get("current-context") for p in merged.paths]
        if any(firsts):
            merged.config.value["current-context"] = next(c for c in firsts if c)
        # Refreshed OIDC/GCP tokens are written back to the file they came from, as kubectl does.
        loader = KubeConfigLoader(config_dict=merged.config, active_context=context, config_base_path=None,
                                  config_persister=merged.save_changes)
        with _logged_errors() as errors:
            loader.load_and_set(conf)
        ctx = loader.current_context
    except ConfigException as e:
        raise KubeConfigError(f"kubeconfig {label}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KubeConfigError(f"kubeconfig {label}: {type(e).__name__}: {e}") from None
    user = (ctx.get("context") or {}).get("user")
    if errors:  # the loader logs, rather than raises, what went wrong in an exec plugin
        raise KubeConfigError(f"kubeconfig {label}: user {user!r}: the credential plugin failed: "
                              + "; ".join(errors))
    if not conf.host:
        raise KubeConfigError(f"kubeconfig {label}: cluster of context {ctx.get('name')!r} has no server")
    expiry = getattr(loader, "expiry", None)  # exec plugins and the GCP provider say when tokens expire
    return _credentials(conf, namespace=(ctx.get("context") or {}).get("namespace") or "default",
                        expires_at=expiry, rereads_file="tokenFile" in _user_section(merged.config, user))


def _load_in_cluster(environ: Mapping[str, str], directory: Path) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.incluster_config import InClusterConfigLoader

    conf = Configuration()
    try:
        InClusterConfigLoader(token_filename=str(directory / "token"), cert_filename=str(directory / "ca.crt"),
                              try_refresh_token=False, environ=dict(environ)).load_and_set(conf)
    except ConfigException as e:
        raise KubeConfigError(f"in-cluster service account {directory}: {e}") from None
    ns_file = directory / "namespace"
    namespace = ns_file.read_text().strip() if ns_file.exists() else "default"
    return _credentials(conf, namespace=namespace or "default", expires_at=None, rereads_file=True)


def _credentials(conf, *, namespace: str, expires_at: datetime.datetime | None,
                 rereads_file: bool) -> Credentials:
    # kubernetes >= 36 keeps the header under "BearerToken", older releases under "authorization".
    header = conf.api_key.get("BearerToken") or conf.api_key.get("authorization")
    if header and header.split(" ", 1)[0].lower() == "bearer":
        header = "Bearer " + header.split(" ", 1)[1].strip()  # the in-cluster loader writes "bearer"
    now_wall, now = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    renew_at = reload_at = None
    if expires_at is not None:
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=datetime.timezone.utc)
        renew_at = max(expires_at - EXPIRY_MARGIN, now_wall + datetime.timedelta(seconds=MIN_RELOAD_SECONDS))
        reload_at = now + (renew_at - now_wall).total_seconds()
    if rereads_file:
        reload_at = min(reload_at or float("inf"), now + TOKEN_FILE_REREAD_SECONDS)
    return Credentials(
        server=conf.host, ca_file=conf.ssl_ca_cert, cert_file=conf.cert_file, key_file=conf.key_file,
        authorization=header, insecure=not conf.verify_ssl, tls_server_name=conf.tls_server_name,
        proxy=conf.proxy, namespace=namespace, expires_at=expires_at, renew_at=renew_at, reload_at=reload_at,
        loaded_at=now)


def _user_section(config, user: str | None) -> dict:
    for item in (config.value.get("users") or []) if user else []:
        item = getattr(item, "value", item)
        if item.get("name") == user:
            return item.get("user") or {}
    return {}


@contextlib.contextmanager
def _logged_errors() -> Iterator[list[str]]:
    """Collect the errors the kubernetes loader logs on this thread (it logs exec plugin failures
    and goes on without credentials, which would surface later as a bare 401)."""
    errors: list[str] = []
    thread = threading.get_ident()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == thread and record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    handler = Collect()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield errors
    finally:
        root.removeHandler(handler)
