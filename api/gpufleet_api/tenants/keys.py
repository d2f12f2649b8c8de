"""API keys: their format, the hashed form a Secret stores, and the check of a request's Bearer header.

A key is ``gfk_`` and 43 base64url characters (32 random bytes): the prefix lets secret scanners and
people recognise one. A Secret never holds a key, only a record per key, one per line:
``sha256:<salt, 32 hex>:<sha256(salt + key), 64 hex>``, the salt 16 random bytes of its own.

Why a salted SHA-256 and not scrypt or bcrypt: the keys are 256 random bits, not passwords a person
chose, so no dictionary or brute force reaches one from its hash whatever the hash's cost; a slow hash
would only add its milliseconds to every request (the check runs per request, against every candidate).
The salt makes the same key in two Secrets (or two namespaces) two unrelated records, so a reader of the
Secrets cannot tell that a key was reused, and no precomputed table applies.

``KeyTable.identify`` hashes the presented key with every record's salt and compares with
``hmac.compare_digest``, over every record with no early exit, so its time says nothing about which
record (or whether any) matched. A key never appears in a message, an exception or a repr.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Mapping

from gpufleet_api.typed import Invalid, Key, Problem

from .identity import Identified, Reason, Refused

KEY_PREFIX = "gfk_"
KEY_BYTES = 32
SALT_BYTES = 16
SCHEME = "sha256"
# A presented key longer than this is malformed before anything is hashed: it bounds the work a caller
# can ask for per request.
MAX_KEY_LENGTH = 256
_KEY = re.compile(r"^[A-Za-z0-9_\-.~+/]+=*$")  # RFC 6750 b64token
_RECORD = re.compile(r"^sha256:([0-9a-f]{32}):([0-9a-f]{64})$")

# What a refused caller is told (HTTP 401 with WWW-Authenticate: Bearer): the reason, never the key.
MESSAGES: dict[Reason, str] = {
    "missing": "This service needs an API key: send it as Authorization: Bearer <key>.",
    "malformed": "The Authorization header must be Bearer <key>, the key one token of at most "
                 f"{MAX_KEY_LENGTH} characters.",
    "unknown": "The API key is not valid here: it may have been rotated or belong to another namespace.",
}


def new_key(entropy: bytes) -> str:
    """A key from ``entropy`` (``secrets.token_bytes(KEY_BYTES)``)."""
    if len(entropy) != KEY_BYTES:
        raise ValueError(f"a key takes {KEY_BYTES} random bytes, got {len(entropy)}")
    return KEY_PREFIX + base64.urlsafe_b64encode(entropy).decode().rstrip("=")


def record(key: str, salt: bytes) -> str:
    """The line a Secret stores for ``key``, hashed with ``salt`` (``secrets.token_bytes(SALT_BYTES)``)."""
    if len(salt) != SALT_BYTES:
        raise ValueError(f"a salt is {SALT_BYTES} random bytes, got {len(salt)}")
    return f"{SCHEME}:{salt.hex()}:{_digest(salt, key).hex()}"


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode()).digest()


@dataclass(frozen=True)
class _Record:
    tenant: str
    salt: bytes = field(repr=False)
    digest: bytes = field(repr=False)


class KeyTable:
    """Every key record of a namespace's tenants. Immutable: a rotation (a Secret changed) builds a new
    table and swaps it in whole."""

    def __init__(self, records: list[_Record]):
        self._records = tuple(records)

    @classmethod
    def parse(cls, secrets: Mapping[str, str], where: Mapping[str, str] | None = None) -> KeyTable:
        """The table of ``secrets``: tenant name → the text of its Secret key (records, one per line;
        blank lines and ``#`` comments skipped). ``where``: tenant → how to name its Secret key in
        errors (e.g. ``secret team-a-keys, key keys``). Raises Invalid naming every bad line."""
        records: list[_Record] = []
        bad: list[Problem] = []
        for tenant, text in secrets.items():
            for n, line in enumerate(text.splitlines(), start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = _RECORD.match(line)
                if m is None:
                    # The line is not echoed: a key pasted by mistake in place of its record stays unsaid.
                    source = (where or {}).get(tenant, f"the keys of tenant {tenant!r}")
                    bad.append(Problem((Key(tenant), n), f"line {n} of {source} is not a key record: each line "
                                       "must be sha256:<32 hex salt>:<64 hex digest> "
                                       "(docs/tenants.md, \"Keys\"), never the key itself"))
                    continue
                records.append(_Record(tenant, bytes.fromhex(m[1]), bytes.fromhex(m[2])))
        if bad:
            raise Invalid(bad)
        return cls(records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"KeyTable({len(self._records)} records)"

    def identify(self, authorization: str | None) -> Identified | Refused:
        """The tenant whose key ``authorization`` (the Authorization header's value) carries, or why not."""
        key = bearer(authorization)
        if isinstance(key, Refused):
            return key
        encoded = key.encode()
        tenants: set[str] = set()
        for r in self._records:
            # Every record is hashed and compared, whichever matched: the time taken is the same for any key.
            if hmac.compare_digest(hashlib.sha256(r.salt + encoded).digest(), r.digest):
                tenants.add(r.tenant)
        # One key in two tenants' Secrets (a record copied by mistake): which tenant it is cannot be known.
        if len(tenants) != 1:
            return _refused("unknown")
        return Identified(tenants.pop())


def bearer(authorization: str | None) -> str | Refused:
    """The key of an ``Authorization: Bearer <key>`` value, or why there is none."""
    if authorization is None or not authorization.strip():
        return _refused("missing")
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or len(key) > MAX_KEY_LENGTH or not _KEY.match(key):
        return _refused("malformed")
    return key


def _refused(reason: Reason) -> Refused:
    return Refused(reason, MESSAGES[reason])
