"""Which superseded image versions to remove, decided from listings (no I/O here).

Every `gpufleet dev images` build is named by a content hash of its inputs, and the
real node imports each new one into containerd: without pruning, the image cache,
dockerd's data root and containerd's store keep every version ever built (the real
node's containerd root reached 43 GB in a day of image imports). Only the current
version of each image is kept: the cache can rebuild or re-import nothing older, and
a new node start re-imports what `images.json` names.

images.py (the cache and dockerd) and node.py (containerd) run the commands.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

HASH = r"[0-9a-f]{12}"


def stale_cache_files(names: Iterable[str], images: Iterable[str], keep: Iterable[str]) -> list[str]:
    """Files of the image cache (``names``, as listed) that an older build left: archives of
    ``images`` (``<image>-<hash>.tar``, or the ``.json`` stamp of an image kept in dockerd only),
    base root filesystems (``base-<hash>.rootfs.tar``) and
    unfinished writes (``.tmp``), except those in ``keep``. Anything else is not touched."""
    kept = set(keep)
    patterns = [re.compile(rf"{re.escape(image)}-{HASH}\.(tar|json|tmp)") for image in images]
    patterns.append(re.compile(rf"base-{HASH}\.rootfs\.(tar|tmp)"))
    return sorted(n for n in names if n not in kept and any(p.fullmatch(n) for p in patterns))


def stale_tags(tags: Iterable[str], repositories: Iterable[str], keep: Iterable[str]) -> list[str]:
    """dockerd's ``repository:tag`` names in ``repositories`` that are not in ``keep``."""
    kept, repos = set(keep), set(repositories)
    return sorted(t for t in tags if t not in kept and t.rpartition(":")[0] in repos)


@dataclass(frozen=True)
class ImageRef:
    """One line of ``ctr images ls``: a name and the manifest (or index) it points at."""
    ref: str
    digest: str


def parse_ctr_images(text: str) -> list[ImageRef]:
    """``ctr images ls`` output (REF TYPE DIGEST SIZE PLATFORMS LABELS) as refs."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[2].startswith("sha256:"):
            out.append(ImageRef(fields[0], fields[2]))
    return out


def _repository(ref: str) -> str:
    name = ref.split("@", 1)[0]
    head, sep, tag = name.rpartition(":")
    return head if sep and "/" not in tag else name


def stale_containerd_refs(refs: Iterable[ImageRef], prefix: str, keep: Iterable[str],
                          in_use: Iterable[str] = ()) -> list[str]:
    """The refs to remove from containerd so that the content of superseded versions can be
    collected: our images' names (under ``prefix``) that point elsewhere than ``keep`` and
    the images containers use (``in_use``, refs), together with the bare ``sha256:<id>``
    names the CRI plugin gives the same manifests. Other images are not touched."""
    refs = list(refs)
    kept_refs = set(keep) | set(in_use)
    kept_digests = {r.digest for r in refs if r.ref in kept_refs}
    ours = [r for r in refs if _repository(r.ref).startswith(prefix + "/")]
    stale_digests = {r.digest for r in ours if r.digest not in kept_digests and r.ref not in kept_refs}
    return sorted(r.ref for r in refs if r.digest in stale_digests and r.ref not in kept_refs and (
        _repository(r.ref).startswith(prefix + "/") or r.ref.startswith("sha256:")))
