"""Which superseded image versions `gpufleet dev` removes from the image cache, dockerd
and the real node's containerd: the current ones and what is not ours stay."""
from gpufleet_dev.devcluster.prune import (
    ImageRef,
    parse_ctr_images,
    stale_cache_files,
    stale_containerd_refs,
    stale_tags,
)

PREFIX = "localhost/gpufleet"


def test_the_cache_keeps_the_current_archives_and_base_and_everything_not_an_archive():
    names = ["engine-cpu-d76a87d82ef2.tar", "engine-cpu-0123456789ab.tar", "engine-cpu-0123456789ab.tmp",
             "operator-ee4d8c47d438.tar", "operator-aaaaaaaaaaaa.tar", "base-f1a524b4bd18.rootfs.tar",
             "base-000000000000.rootfs.tar", "pause-1.tar", "images.json", "engine-cpu.build.log",
             "engine-cpu-notahash.tar"]
    keep = {"engine-cpu-d76a87d82ef2.tar", "operator-ee4d8c47d438.tar", "base-f1a524b4bd18.rootfs.tar"}
    assert stale_cache_files(names, ["engine-cpu", "operator"], keep) == [
        "base-000000000000.rootfs.tar", "engine-cpu-0123456789ab.tar", "engine-cpu-0123456789ab.tmp",
        "operator-aaaaaaaaaaaa.tar"]


def test_an_image_not_rebuilt_keeps_its_last_archive():
    names = ["engine-cpu-d76a87d82ef2.tar", "engine-cpu-0123456789ab.tar", "operator-aaaaaaaaaaaa.tar"]
    assert stale_cache_files(names, ["engine-cpu"], {"engine-cpu-d76a87d82ef2.tar"}) == [
        "engine-cpu-0123456789ab.tar"]


def test_dockerd_keeps_the_current_tags_and_other_repositories():
    tags = [f"{PREFIX}/engine-cpu:d76a87d82ef2", f"{PREFIX}/engine-cpu:0123456789ab", f"{PREFIX}/engine-cpu:dev",
            f"{PREFIX}/base:f1a524b4bd18", f"{PREFIX}/base:000000000000", f"{PREFIX}/operator:aaaaaaaaaaaa",
            "debian:bookworm", "<none>:<none>"]
    keep = {f"{PREFIX}/engine-cpu:d76a87d82ef2", f"{PREFIX}/engine-cpu:dev", f"{PREFIX}/base:f1a524b4bd18"}
    assert stale_tags(tags, [f"{PREFIX}/engine-cpu", f"{PREFIX}/base"], keep) == [
        f"{PREFIX}/base:000000000000", f"{PREFIX}/engine-cpu:0123456789ab"]


M = "application/vnd.docker.distribution.manifest.v2+json"
CRI = "io.cri-containerd.image=managed"
CTR_LS = f"""REF TYPE DIGEST SIZE PLATFORMS LABELS
{PREFIX}/engine-cpu:0123456789ab {M} sha256:old 4.1 GiB linux/amd64 {CRI}
{PREFIX}/engine-cpu:d76a87d82ef2 {M} sha256:new 4.1 GiB linux/amd64 {CRI}
{PREFIX}/engine-cpu:dev {M} sha256:new 4.1 GiB linux/amd64 {CRI}
{PREFIX}/operator:aaaaaaaaaaaa {M} sha256:op-old 350.0 MiB linux/amd64 -
{PREFIX}/pause:1 {M} sha256:pause 700.0 KiB linux/amd64 -
sha256:config-old {M} sha256:old 4.1 GiB linux/amd64 -
sha256:config-new {M} sha256:new 4.1 GiB linux/amd64 -
sha256:someone-elses {M} sha256:other 1.0 MiB linux/amd64 -
docker.io/library/busybox:1 {M} sha256:busy 1.0 MiB linux/amd64 -
"""


def test_containerd_loses_superseded_versions_with_their_bare_ids_and_keeps_the_rest():
    refs = parse_ctr_images(CTR_LS)
    assert ImageRef(f"{PREFIX}/pause:1", "sha256:pause") in refs and len(refs) == 9
    keep = {f"{PREFIX}/engine-cpu:d76a87d82ef2", f"{PREFIX}/pause:1", f"{PREFIX}/engine-cpu:dev"}
    assert stale_containerd_refs(refs, PREFIX, keep) == [
        f"{PREFIX}/engine-cpu:0123456789ab", f"{PREFIX}/operator:aaaaaaaaaaaa", "sha256:config-old"]


def test_containerd_keeps_what_a_container_still_uses():
    refs = parse_ctr_images(CTR_LS)
    keep = {f"{PREFIX}/engine-cpu:d76a87d82ef2", f"{PREFIX}/pause:1"}
    in_use = {f"{PREFIX}/engine-cpu:0123456789ab"}
    assert stale_containerd_refs(refs, PREFIX, keep, in_use) == [f"{PREFIX}/operator:aaaaaaaaaaaa"]


def test_a_name_sharing_the_current_manifest_stays():
    refs = [ImageRef(f"{PREFIX}/engine-cpu:dev", "sha256:new"), ImageRef(f"{PREFIX}/engine-cpu:abc", "sha256:new")]
    assert stale_containerd_refs(refs, PREFIX, {f"{PREFIX}/engine-cpu:abc"}) == []


def test_the_wheel_server_keeps_its_address_so_install_layers_stay_cached(tmp_path, monkeypatch):
    """dockerd keys a RUN step's cache on the build arguments, PIP_FIND_LINKS among them: the same URL
    on every build, or each rebuild reinstalls every wheel."""
    import socket

    import httpx

    from gpufleet_dev.devcluster import wheelhouses
    from gpufleet_kit.ports import unused_port

    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    # Not the real fixed port: `make test` runs these tests while setup's image builds serve their
    # wheels there, and a build holding it would look like the fallback below.
    monkeypatch.setattr(wheelhouses, "WHEEL_SERVER_PORT", unused_port("127.0.0.1"))
    house = tmp_path / "wheelhouse" / "engine-abc"
    house.mkdir(parents=True)
    (house / "x-1.0-py3-none-any.whl").write_bytes(b"wheel")
    urls = []
    for _ in range(2):
        with wheelhouses.serve_wheelhouses({"engine": house}) as served:
            assert "x-1.0-py3-none-any.whl" in httpx.get(served["engine"], trust_env=False).text
            urls.append(served["engine"])
    assert urls[0] == urls[1] == f"http://127.0.0.1:{wheelhouses.WHEEL_SERVER_PORT}/engine-abc/"
    with socket.socket() as taken:  # the port in use: any other, and the build still gets its wheels
        taken.bind(("127.0.0.1", 0))
        monkeypatch.setattr(wheelhouses, "WHEEL_SERVER_PORT", taken.getsockname()[1])
        with wheelhouses.serve_wheelhouses({"engine": house}) as served:
            assert f":{taken.getsockname()[1]}/" not in served["engine"]
            assert httpx.get(served["engine"] + "x-1.0-py3-none-any.whl", trust_env=False).content == b"wheel"
