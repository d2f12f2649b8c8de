"""An adapter's files onto this replica: the guard's adapter agent calls ``fetch`` on a thread.

A ``path`` source (a mounted claim) is read in place. A ``uri`` is a tar archive (gzip or not)
of the adapter's folder over http or https; it is extracted into ``<adapter dir>/<name>/`` as it
downloads, only while every member is a plain file or folder inside that folder: no absolute
paths, no ``..``, no links or devices (an archive a user can point the guard at must not write
anywhere else in the pod). A ``huggingFace`` source is downloaded with
``huggingface_hub.snapshot_download`` at its revision into the same folder, in a child process that
may reach the Hub although the pod runs with ``HF_HUB_OFFLINE=1``. Each replaces what
a previous fetch of that name left, atomically: a half-fetched folder is never handed to vLLM.

Sources are untrusted input (guard.json's ``adapters``, AdapterFetchConfig, bounds them): the bytes
downloaded and the bytes extracted are each capped at ``maxBytes`` and the archive's (or
snapshot's, or folder's) members at ``maxMembers``, reading stops as soon as a cap is passed and the
partial folder is removed; one deadline (``fetchTimeoutSeconds``) bounds the whole fetch. A ``uri``
is http or https only (``file://`` is refused: a mounted claim is ``source.path``); its host is
resolved and every address checked (loopback, link-local, private, unspecified and multicast are
refused unless ``allowPrivateSources``), and the connection goes to the address checked, with the
URI's host in the Host header and TLS's server name; a redirect is followed only to the same scheme
and a checked address. Every message shows the URI redacted (``gpufleet_api.redact``).

Failures are ``AdapterProblem``: SourceUnreachable (network, HTTP, Hub, the deadline; the agent
retries with backoff) or MissingFiles (nothing there, not an archive it may extract, too large,
a refused source).
"""
from __future__ import annotations

import http.client
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from pathlib import Path, PurePosixPath
from typing import IO, Callable

from gpufleet_api import redact
from gpufleet_api.guard.adapters import AdapterSpec
from gpufleet_api.guard.guard_config import AdapterFetchConfig
from gpufleet_engine.serving.adapter_check import CONFIG_FILE, AdapterProblem

UNREACHABLE, MISSING = "SourceUnreachable", "MissingFiles"
DEFAULT_LIMITS = AdapterFetchConfig()
MAX_REDIRECTS = 5
CHUNK = 1 << 20
_REDIRECTS = (301, 302, 303, 307, 308)
# Shared address space (RFC 6598, carrier-grade NAT; some clusters' pod networks): private here.
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_ALLOW_HINT = ("a platform admin may allow such sources: adapters.allowPrivateSources in guard.json "
               "(the chart's adapters.allowPrivateSources)")

Download = Callable[..., str]  # huggingface_hub.snapshot_download's signature


class Deadline:
    """One deadline for a whole fetch: ``left`` is the time left, or SourceUnreachable once it passed."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        left = self.end - self.clock()
        if left <= 0:
            raise AdapterProblem(UNREACHABLE, f"the fetch took longer than {self.seconds:g}s "
                                              f"(adapters.fetchTimeoutSeconds in guard.json)")
        return left


def fetch(spec: AdapterSpec, adapter_dir: Path, *, limits: AdapterFetchConfig = DEFAULT_LIMITS,
          download: Download | None = None) -> Path:
    """The folder holding ``spec``'s adapter on this replica, fetched if it must be."""
    source = spec.source
    deadline = Deadline(limits.fetch_timeout_seconds)
    if source.path is not None:
        path = Path(source.path)
        if not path.is_dir():
            raise AdapterProblem(MISSING, f"no folder at {source.path} (source.path)")
        measure(path, limits, f"the folder {source.path} (source.path)")
        return path
    target = adapter_dir / spec.name
    if source.uri is not None:
        uri = source.uri
        return _into(target, lambda tmp: _fetch_archive(uri, tmp, limits, deadline))
    if source.hugging_face is not None:
        hub = source.hugging_face
        return _into(target, lambda tmp: _fetch_hub(hub.name, hub.revision, tmp, limits, deadline, download))
    raise AdapterProblem(MISSING, "the adapter has no source (huggingFace, path or uri)")


def _into(target: Path, fill: Callable[[Path], Path]) -> Path:
    """Fill a new folder beside ``target`` and put it in ``target``'s place; the adapter's folder.
    A fill that fails leaves nothing behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        inner = fill(tmp)
        relative = inner.relative_to(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
        return target / relative
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove(spec: AdapterSpec, adapter_dir: Path) -> None:
    """Delete what ``fetch`` put on this replica for ``spec`` (a ``path`` source is not ours)."""
    if spec.source.path is None:
        shutil.rmtree(adapter_dir / spec.name, ignore_errors=True)


def _too_large(what: str, limits: AdapterFetchConfig) -> AdapterProblem:
    return AdapterProblem(MISSING, f"{what} is too large: over {limits.max_bytes} bytes, this adapter's share of "
                                   f"the adapter storage (adapters.maxBytes in guard.json; raise "
                                   f"spec.engine.lora.adapterStorage or lower maxAdapters)")


def _too_many(what: str, limits: AdapterFetchConfig) -> AdapterProblem:
    return AdapterProblem(MISSING, f"{what} has too many files: over {limits.max_members} "
                                   f"(adapters.maxMembers in guard.json)")


def measure(folder: Path, limits: AdapterFetchConfig, what: str) -> None:
    """Too large or too many files (MissingFiles) when ``folder`` holds more than ``limits`` allow;
    the walk stops at the first cap passed and follows no links."""
    total = count = 0
    for root, dirs, files in os.walk(folder):
        count += len(dirs) + len(files)
        if count > limits.max_members:
            raise _too_many(what, limits)
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # renamed while a download runs
                continue
            if total > limits.max_bytes:
                raise _too_large(what, limits)


# --- a uri: a tar archive over http or https ----------------------------------------------------------


def refused_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What makes ``ip`` an address adapters are not fetched from unless allowed; None: a public one."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED):
        return "private"
    if ip.is_reserved:
        return "reserved"
    return None


def vetted_address(host: str, port: int, limits: AdapterFetchConfig, shown: str) -> str:
    """The address to connect to for ``host``: every address it resolves to is checked, and the
    first is used (the connection goes there, not to a second resolution)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise AdapterProblem(UNREACHABLE, f"cannot resolve the host of {shown}: {e}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise AdapterProblem(UNREACHABLE, f"the host of {shown} resolves to no address")
    if not limits.allow_private_sources:
        for address in addresses:
            kind = refused_kind(ipaddress.ip_address(address.split("%", 1)[0]))
            if kind is not None:
                raise AdapterProblem(MISSING, f"{shown}: the host resolves to {address}, a {kind} address; "
                                              f"adapters are fetched from public addresses only ({_ALLOW_HINT})")
    return addresses[0]


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to a checked address, with the URI's host in the Host header."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._create_connection = _pinned(address)  # type: ignore[method-assign,assignment]


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to a checked address; TLS's server name and certificate check are the host's."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._create_connection = _pinned(address)  # type: ignore[method-assign,assignment]


def _pinned(address: str) -> Callable[..., socket.socket]:
    def connect(where: tuple[str, int], timeout: float, source_address: tuple[str, int] | None = None) -> socket.socket:
        return socket.create_connection((address, where[1]), timeout, source_address)
    return connect


def open_uri(uri: str, limits: AdapterFetchConfig, deadline: Deadline) -> tuple[http.client.HTTPResponse,
                                                                                 http.client.HTTPConnection]:
    """GET ``uri`` (http or https), following redirects of the same scheme to checked addresses only."""
    shown = redact.uri(uri)
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(uri)
        here = redact.uri(uri)
        if parts.scheme.lower() != scheme:
            raise AdapterProblem(MISSING, f"{shown} redirects to {here}: a redirect may not change the scheme "
                                          f"({scheme} to {parts.scheme or 'none'})")
        try:
            host, port = parts.hostname, parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise AdapterProblem(MISSING, f"{here} has no valid port") from None
        if not host:
            raise AdapterProblem(MISSING, f"{here} names no host")
        address = vetted_address(host, port, limits, here)
        conn: http.client.HTTPConnection = (_PinnedHTTPS if scheme == "https" else _PinnedHTTP)(
            host, port, address, deadline.left())
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers={"Accept-Encoding": "identity", "User-Agent": "gpufleet-guard"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            deadline.left()
            raise AdapterProblem(UNREACHABLE, f"cannot read {here}: {redact.text(str(e)) or type(e).__name__}") \
                from None
        if resp.status in _REDIRECTS:
            location = resp.getheader("Location")
            conn.close()
            if not location:
                raise AdapterProblem(UNREACHABLE, f"{here} answered HTTP {resp.status} without a Location")
            uri = urllib.parse.urljoin(uri, location)
            continue
        if resp.status != 200:
            conn.close()
            raise AdapterProblem(UNREACHABLE, f"{here} answered HTTP {resp.status} {resp.reason}")
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > limits.max_bytes:
            conn.close()
            raise _too_large(f"the archive at {here} ({length} bytes)", limits)
        return resp, conn
    raise AdapterProblem(MISSING, f"{shown} redirects more than {MAX_REDIRECTS} times")


class CappedReader:
    """A response's body, read at most ``limits.max_bytes`` (then too large) and within the deadline."""

    def __init__(self, resp: IO[bytes], conn: http.client.HTTPConnection | None, limits: AdapterFetchConfig,
                 deadline: Deadline, shown: str):
        self.resp, self.conn, self.limits, self.deadline, self.shown = resp, conn, limits, deadline, shown
        self.count = 0

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (fewer only at the end), one receive at a time: the deadline is checked
        between receives, so a source that trickles a byte at a time still stops at the deadline."""
        want = min(CHUNK if size is None or size < 0 else size, self.limits.max_bytes - self.count + 1)
        out = bytearray()
        read1 = getattr(self.resp, "read1", self.resp.read)
        while len(out) < want:
            left = self.deadline.left()
            if self.conn is not None and self.conn.sock is not None:
                self.conn.sock.settimeout(left)
            try:
                data = read1(want - len(out))
            except (OSError, http.client.HTTPException) as e:
                self.deadline.left()
                raise AdapterProblem(UNREACHABLE, f"cannot read {self.shown}: "
                                                  f"{redact.text(str(e)) or type(e).__name__}") from None
            if not data:
                break
            out += data
            self.count += len(data)
            if self.count > self.limits.max_bytes:
                raise _too_large(f"the archive at {self.shown}", self.limits)
        return bytes(out)


def _fetch_archive(uri: str, into: Path, limits: AdapterFetchConfig, deadline: Deadline) -> Path:
    shown = redact.uri(uri)
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    if scheme == "file":
        raise AdapterProblem(MISSING, f"spec.source.uri {shown!r}: file:// URIs are not fetched; for an adapter on "
                                      f"a mounted claim set spec.source.pvc on the InferenceAdapter "
                                      f"(spec.source.path in PUT /adapters) instead")
    if scheme not in ("http", "https"):
        raise AdapterProblem(MISSING, f"spec.source.uri {shown!r}: only http and https URLs of a tar archive "
                                      f"are fetched")
    resp, conn = open_uri(uri, limits, deadline)
    folder = into / "adapter"
    try:
        extract_stream(CappedReader(resp, conn, limits, deadline, shown), folder, limits)
    finally:
        conn.close()
    return adapter_root(folder)


def extract(archive: Path, folder: Path, limits: AdapterFetchConfig = DEFAULT_LIMITS) -> None:
    """Extract the tar archive at ``archive`` into ``folder`` (``extract_stream``)."""
    with archive.open("rb") as f:
        extract_stream(CappedReader(f, None, limits, Deadline(limits.fetch_timeout_seconds), str(archive)),
                       folder, limits)


def extract_stream(fileobj: CappedReader, folder: Path, limits: AdapterFetchConfig) -> None:
    """Extract a tar archive (gzip or not) read once from ``fileobj`` into ``folder``, as it arrives:
    every member a plain file or folder inside it, at most ``limits.max_members`` of them holding at
    most ``limits.max_bytes`` in all, else MissingFiles naming the first that is not (the caller
    removes what was extracted). Files get mode 0644, folders 0755."""
    folder.mkdir(parents=True)
    members = written = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as tar:  # type: ignore[call-overload]
            for member in tar:
                members += 1
                if members > limits.max_members:
                    raise _too_many("the archive", limits)
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise AdapterProblem(MISSING, f"the archive's member {member.name!r} points outside its "
                                                  f"folder; refused")
                if not (member.isfile() or member.isdir()) or member.issparse():
                    raise AdapterProblem(MISSING, f"the archive's member {member.name!r} is a link or a device; "
                                                  f"an adapter's archive holds plain files only")
                target = folder.joinpath(*name.parts)
                if member.isdir():
                    target.mkdir(mode=0o755, parents=True, exist_ok=True)
                    continue
                written += member.size
                if written > limits.max_bytes:
                    raise _too_large("the archive's extracted files", limits)
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None  # a plain file
                with open(target, "wb") as out:
                    shutil.copyfileobj(source, out, CHUNK)
                os.chmod(target, 0o644)
    except AdapterProblem:
        raise
    except (tarfile.TarError, EOFError, OSError) as e:
        raise AdapterProblem(MISSING, f"not a tar archive the guard can extract: {redact.text(str(e))}") from None


def adapter_root(folder: Path) -> Path:
    """Where the adapter's files are: ``folder``, or its one sub-folder holding adapter_config.json
    (an archive made with ``tar -C parent adapter/``)."""
    if (folder / CONFIG_FILE).exists():
        return folder
    subfolders = [p for p in folder.iterdir() if p.is_dir()]
    if len(subfolders) == 1 and (subfolders[0] / CONFIG_FILE).exists():
        return subfolders[0]
    return folder  # the check names what is missing


# --- a huggingFace source ---------------------------------------------------------------------------


def _fetch_hub(repo: str, revision: str | None, into: Path, limits: AdapterFetchConfig, deadline: Deadline,
               download: Download | None) -> Path:
    folder = into / "adapter"
    shown = f"{repo}{'@' + revision if revision else ''} from the Hub"
    try:
        if download is None:
            _download_online(repo_id=repo, revision=revision, local_dir=str(folder), limits=limits,
                             deadline=deadline, shown=shown)
        else:
            download(repo_id=repo, revision=revision, local_dir=str(folder))
    except AdapterProblem:
        raise
    except Exception as e:  # the Hub's errors (not found, gated, network) all mean: not fetched
        raise AdapterProblem(UNREACHABLE, f"cannot download {shown}: {type(e).__name__}: "
                                          f"{redact.text(str(e))}") from None
    measure(folder, limits, shown)
    return folder


def _download_online(*, repo_id: str, revision: str | None, local_dir: str, limits: AdapterFetchConfig,
                     deadline: Deadline, shown: str, poll_seconds: float = 0.5) -> str:
    """huggingface_hub's snapshot_download in a child process with HF_HUB_OFFLINE=0: the pod runs with
    HF_HUB_OFFLINE=1 (vLLM and the guard read the base model from what model-fetch cached, and
    huggingface_hub reads the switch once, at import), while an adapter is downloaded on purpose, at
    run time. HF_ENDPOINT and HF_TOKEN pass through (a mirror, a private adapter). The child is
    stopped as soon as the folder (partial downloads included) passes a cap, or at the deadline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}
    code = ("import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3])")
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen([sys.executable, "-c", code, repo_id, revision or "", local_dir], env=env,
                                 stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            while True:
                try:
                    child.wait(timeout=min(poll_seconds, deadline.left()))
                    break
                except subprocess.TimeoutExpired:
                    if Path(local_dir).exists():
                        measure(Path(local_dir), limits, shown)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if child.returncode != 0:
            stderr.seek(0)
            lines = stderr.read()[-8192:].decode(errors="replace").strip().splitlines() or ["no output"]
            raise RuntimeError(lines[-1][-500:])
    return local_dir
