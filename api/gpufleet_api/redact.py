"""URIs as they may be shown: in a message, a status, an Event, a log line or ``GET /adapters``.

A source URI may carry a secret: credentials in its userinfo (``https://user:token@host/``) or a
presigned signature in its query string (``?X-Amz-Signature=...``). Everything gpufleet shows of a
URI goes through ``uri`` (one URI) or ``text`` (a message that may hold some): the userinfo and
the fragment are dropped and the query string is replaced by ``<redacted>``, so
``https://bucket.s3/x.tgz?X-Amz-Signature=abc`` is shown as ``https://bucket.s3/x.tgz?<redacted>``.
"""
from __future__ import annotations

import re
import urllib.parse

REDACTED = "<redacted>"
# A URI inside free text: a scheme, "://", then anything up to white space or a quote.
_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def uri(value: str) -> str:
    """``value`` without its userinfo, query string and fragment (the query shown as ``?<redacted>``)."""
    try:
        parts = urllib.parse.urlsplit(value)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # not a URI urllib can split (a bad port, a bad IPv6 literal): show its scheme only
        scheme = value.split(":", 1)[0] if "://" in value else ""
        return f"{scheme}://{REDACTED}" if scheme else REDACTED
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    query = REDACTED if parts.query or value.split("#", 1)[0].endswith("?") else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def text(message: str) -> str:
    """``message`` with every URI in it redacted (``uri``)."""
    return _IN_TEXT.sub(lambda m: uri(m.group(0)), message)
