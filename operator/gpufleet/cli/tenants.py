"""`gpufleet tenants new-key` and `add-key`: a tenant's API key, shown once, and the Secret manifest that
holds only its record (docs/tenants.md, "Keys"). Nothing here talks to the cluster: the manifest is applied
by whoever holds the rights to write Secrets in the namespace (`kubectl apply -f`)."""
from __future__ import annotations

import base64
import re
import secrets
from datetime import datetime, timezone
from typing import Any, Callable

import click
import yaml

from gpufleet_api.tenants import keys
from gpufleet_api.tenants.usage import KEYS_SECRET_LABEL
from gpufleet_api.typed import Invalid
from gpufleet_api.v1alpha1 import DNS_LABEL, DNS_SUBDOMAIN

DEFAULT_DATA_KEY = "keys"  # the key inside the Secret; the declaration names it: keys: {name: ..., key: keys}
WARNING = ("This is the only time the key is shown: store it now (a secrets manager, the client's own "
           "Secret). The manifest holds only its salted hash; a lost key cannot be recovered, only replaced.")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def new_record(*, entropy: Callable[[int], bytes] = secrets.token_bytes,
               now: Callable[[], datetime] = _now) -> tuple[str, str]:
    """A new key and the lines its Secret stores: a dated comment (which line to delete at the next
    rotation) and the record."""
    key = keys.new_key(entropy(keys.KEY_BYTES))
    lines = f"# added {now().strftime('%Y-%m-%dT%H:%M:%SZ')}\n{keys.record(key, entropy(keys.SALT_BYTES))}\n"
    return key, lines


def secret_manifest(*, tenant: str, namespace: str, name: str, data_key: str, records: str) -> dict:
    """The Secret the router reads a tenant's key records from: labelled for its label-selected watch."""
    return {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {KEYS_SECRET_LABEL: "true", "app.kubernetes.io/part-of": "gpufleet"},
                     "annotations": {"gpufleet.dev/tenant": tenant}},
        "type": "Opaque",
        "stringData": {data_key: records},
    }


class ManifestError(click.ClickException):
    """A manifest file that is not a tenant keys Secret gpufleet can add to."""


def add_record(manifest: Any, lines: str, data_key: str | None, *, source: str) -> dict:
    """``manifest`` (a decoded Secret) with ``lines`` appended to its records, as stringData; the
    records it had (stringData or base64 data) kept, checked, in order."""
    if not isinstance(manifest, dict) or manifest.get("kind") != "Secret":
        raise ManifestError(f"{source} is not a Secret manifest (kind: Secret); make one with "
                            "`gpufleet tenants new-key`")
    string_data = dict(manifest.get("stringData") or {})
    for k, v in (manifest.get("data") or {}).items():
        try:
            string_data.setdefault(k, base64.b64decode(v, validate=True).decode())
        except (ValueError, TypeError):
            raise ManifestError(f"{source}: data.{k} is not base64 text") from None
    if data_key is None:
        if len(string_data) != 1:
            raise ManifestError(f"{source} holds {len(string_data)} keys ({', '.join(sorted(string_data)) or 'none'}); "
                                "name the one holding the records with --key")
        (data_key,) = string_data
    existing = string_data.get(data_key, "")
    name = manifest.get("metadata", {}).get("name", "?")
    try:
        keys.KeyTable.parse({name: existing}, where={name: f"{source}, key {data_key}"})
    except Invalid as e:
        raise ManifestError(str(e)) from None
    if existing and not existing.endswith("\n"):
        existing += "\n"
    string_data[data_key] = existing + lines
    out = {k: v for k, v in manifest.items() if k != "data"}
    labels = out.setdefault("metadata", {}).setdefault("labels", {})
    labels[KEYS_SECRET_LABEL] = "true"
    out["stringData"] = string_data
    return out


def _dump(manifest: dict) -> str:
    # Records as a literal block, one per line, as a person reading the file expects them.
    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)
    Dumper.add_representer(str, text)
    return yaml.dump(manifest, Dumper=Dumper, sort_keys=False, width=120)


def _name(kind: str, pattern: str, max_length: int):
    def check(ctx, param, value):
        if value is not None and (len(value) > max_length or not re.match(pattern, value)):
            raise click.BadParameter(f"{value!r} is not a {kind} (lowercase letters, digits and '-', "
                                     f"at most {max_length} characters)")
        return value
    return check


@click.group()
def tenants() -> None:
    """Tenants' API keys (docs/tenants.md): make one, or add one to a Secret for a rotation."""


@tenants.command("new-key")
@click.option("--tenant", required=True, callback=_name("DNS label", DNS_LABEL, 63),
              help="The tenant (its name in the namespace's InferenceTenants).")
@click.option("--namespace", "-n", required=True, callback=_name("namespace name", DNS_LABEL, 63),
              help="The namespace of the tenants declaration and of the Secret.")
@click.option("--secret", callback=_name("Secret name", DNS_SUBDOMAIN, 253),
              help="The Secret's name. Default: <tenant>-api-keys.")
@click.option("--key", "data_key", default=DEFAULT_DATA_KEY, show_default=True,
              help="The key inside the Secret holding the records (the declaration's keys.key).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True),
              help="Write the manifest here instead of stdout (stdout then carries the key alone).")
def new_key(tenant: str, namespace: str, secret: str | None, data_key: str, output: str | None) -> None:
    """Make an API key for a tenant: print the key once, and the Secret manifest holding only its
    salted hash, labelled for the router's watch. Apply the manifest, give the key to the tenant."""
    name = secret or f"{tenant}-api-keys"
    key, lines = new_record()
    text = _dump(secret_manifest(tenant=tenant, namespace=namespace, name=name, data_key=data_key, records=lines))
    click.echo(WARNING, err=True)
    click.echo(key)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
        click.echo(f"wrote {output}: kubectl apply -f {output}", err=True)
    else:
        click.echo("---\n" + text, nl=False)
    click.echo(f"In the namespace's InferenceTenants, tenant {tenant}: keys: {{name: {name}, key: {data_key}}}",
               err=True)


@tenants.command("add-key")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, writable=True))
@click.option("--key", "data_key", help="The key inside the Secret holding the records (needed when it has several).")
def add_key(manifest: str, data_key: str | None) -> None:
    """Rotate: add a new key's record to the Secret manifest MANIFEST (rewritten in place, its other
    records kept), and print the new key once. Apply it, move the clients to the new key, then delete the
    old key's line and apply again."""
    with open(manifest, encoding="utf-8") as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ManifestError(f"{manifest} is not YAML: {e}") from None
    key, lines = new_record()
    text = _dump(add_record(doc, lines, data_key, source=manifest))
    with open(manifest, "w", encoding="utf-8") as f:
        f.write(text)
    click.echo(WARNING, err=True)
    click.echo(key)
    click.echo(f"added to {manifest}: kubectl apply -f {manifest}", err=True)
