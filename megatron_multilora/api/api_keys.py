"""The service's API keys: each key is one tenant, who sees only its own training clients,
samplers and checkpoints. Keys come from a file (one per line, ``#`` comments) or the
``MMLORA_API_KEYS`` environment variable (comma-separated); there is no default key."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ENV = "MMLORA_API_KEYS"


class APIKeyError(ValueError):
    """No usable keys: the message says where they were looked for and what is wrong."""


def load_keys(keys_file: str | None) -> dict[str, str]:
    """``{key: tenant id}`` (the tenant id, a digest of the key, names its folders)."""
    if keys_file:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except OSError as err:
            raise APIKeyError(
                f"api.keys_file={keys_file}: cannot read it ({err.strerror})"
            ) from None
        where = f"api.keys_file={keys_file}"
    else:
        lines = os.environ.get(ENV, "").split(",")
        where = f"${ENV}"
    keys = [line.split("#", 1)[0].strip() for line in lines]
    keys = [key for key in keys if key]
    if not keys:
        raise APIKeyError(
            f"no API keys in {where}: give api.keys_file=FILE (one key per line) or "
            f"set {ENV}=key1,key2; the service has no default key"
        )
    bad = [key[:8] for key in keys if not key.startswith("tml-")]
    if bad:
        raise APIKeyError(
            f"{where}: keys must start with 'tml-' (the tinker SDK refuses others): "
            f"{', '.join(b + '...' for b in bad)}"
        )
    return {key: "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:12] for key in keys}
