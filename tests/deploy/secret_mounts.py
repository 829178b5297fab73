"""Files that containers read from mounted Secrets, and local stand-ins for them.

A manifest names certificate, key and API-keys files by their path inside the pod
(``/etc/specserve/tls/tls.crt``). :func:`secret_files` says which Secret key each such
path is, and whether it is mounted read-only; :class:`StandIns` writes a real local
file per Secret key (a test CA's certificate, key and CA, a valid API-keys file), so a
container's command can be turned into its config by the real code, which reads them.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.manifests import Doc
from tests.security.certs import make_ca


@dataclass(frozen=True)
class SecretFile:
    """One file a container sees from a Secret volume."""

    secret: str
    key: str
    read_only: bool
    mode: int | None  # the volume's defaultMode or the item's mode (None: 0644)


def secret_volumes(pod_spec: Doc) -> dict[str, Doc]:
    """Volume name -> its ``secret`` source, for the pod's Secret volumes."""
    return {v["name"]: v["secret"] for v in pod_spec.get("volumes", []) if "secret" in v}


def secret_files(pod_spec: Doc, c: Doc) -> dict[str, SecretFile]:
    """Path in the container -> the Secret key behind it, for Secret volumes with ``items``
    (without items the keys are whatever the Secret holds: no file is known)."""
    secrets = secret_volumes(pod_spec)
    files: dict[str, SecretFile] = {}
    for m in c.get("volumeMounts", []):
        source = secrets.get(m["name"])
        if source is None or "subPath" in m:
            continue
        for item in source.get("items", []):
            path = posixpath.join(m["mountPath"], item["path"])
            mode = item.get("mode", source.get("defaultMode"))
            files[path] = SecretFile(
                source["secretName"], item["key"], bool(m.get("readOnly")), mode
            )
    return files


API_KEYS_TEXT = "# a stand-in key for the manifest checks\nstand-in-key-0123456789abcdef\n"
INTERNAL_TOKEN_TEXT = "stand-in-internal-token-0123456789\n"


class StandIns:
    """A local file for each Secret key the manifests mount: ``tls.crt``, ``tls.key`` and
    ``ca.crt`` from a throwaway CA, ``api-keys`` a one-key file, ``internal-token`` a token."""

    def __init__(self, directory: Path) -> None:
        ca = make_ca(directory, "manifests")
        leaf = ca.issue("pool")
        keys = directory / "api-keys"
        keys.write_text(API_KEYS_TEXT)
        token = directory / "internal-token"
        token.write_text(INTERNAL_TOKEN_TEXT)
        self.by_key = {
            "tls.crt": leaf.cert,
            "tls.key": leaf.key,
            "ca.crt": ca.ca_file,
            "api-keys": str(keys),
            "internal-token": str(token),
        }

    def local_paths(self, pod_spec: Doc, c: Doc) -> dict[str, str]:
        """Path in the container -> the local stand-in, for every mounted Secret file."""
        local = {}
        for path, f in secret_files(pod_spec, c).items():
            assert f.key in self.by_key, f"no stand-in for Secret key {f.key!r} ({path})"
            local[path] = self.by_key[f.key]
        return local
