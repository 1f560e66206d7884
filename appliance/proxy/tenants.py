"""Who a client is, and what keeps clients apart: API keys by name, and a vLLM `cache_salt` per key.

A tenant is the name of the API key a request carried (`api_key_file`'s single key is "default"; `api_keys_file`
names each one). Each tenant's requests reach the engines with a `cache_salt` derived from a node secret and its
name, so no two tenants share prefix-cache entries (vLLM mixes the salt into the hash of a prompt's first block, so
every block of the chain differs) and the proxy's own prefix affinity, which keys on the salt, never matches one
tenant's prompt against another's blocks. A client's own `cache_salt` splits its tenant's cache further: it is
combined with the tenant's, never used instead (docs/threat-model.md, "What a tenant can learn").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from appliance.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("appliance.proxy")

DEFAULT_TENANT = "default"  # the name of api_key_file's one key
ANONYMOUS = ""  # every client of a proxy without keys
# vLLM's own bounds on a client's cache_salt (entrypoints' validate_cache_salt): a salt it would refuse is refused
# here too, before it is combined into one it would accept
SALT_MAX = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_secret_file(path: Path, what: str) -> os.stat_result:
    """Refuse a secret file that is not a regular file, or that a user other than its owner (the proxy's user or
    root) may change; warn when others may read it. Returns its stat."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 or info.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what} {path} may be changed by other users (mode {mode:o}, owner uid {info.st_uid})",
                          fix=f"chown it to the proxy's user and chmod 600 {path}")
    if mode & 0o044:
        log.warning("%s %s has mode %o: other users can read it (chmod 600 %s)", what, path, mode, path)
    return info


def read_keys(path: str) -> dict[str, str]:
    """The API keys file: TOML, one `name = "key"` per client (names [A-Za-z0-9._-], keys unique and non-empty)."""
    p = Path(path)
    check_secret_file(p, "API keys file")
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"API keys file {path} cannot be read: {exc}",
                          fix='write one line per client: name = "key"') from None
    keys: dict[str, str] = {}
    for name, key in data.items():
        if not _NAME.fullmatch(name):
            raise ConfigError(f"API keys file {path}: name {ascii(name)[:80]} must be 1-64 of [A-Za-z0-9._-]")
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"API keys file {path}: the key of {name} must be a non-empty string")
        if key.strip() in keys.values():
            raise ConfigError(f"API keys file {path}: {name} has the same key as another name; a key names one "
                              "client")
        keys[name] = key.strip()
    if not keys:
        raise ConfigError(f"API keys file {path} has no key", fix='write one line per client: name = "key"')
    return keys


class Tenants:
    """The API keys the proxy accepts, by tenant name, and each tenant's cache salt."""

    def __init__(self, keys: dict[str, str], salt_secret: bytes | None) -> None:
        # keys as bytes, compared in constant time, all of them on every request: the time a check takes does
        # not depend on which key (if any) matched, nor on how much of one did
        self._keys = [(name, key.encode()) for name, key in keys.items()]
        self._secret = salt_secret

    @property
    def required(self) -> bool:
        """True when clients must send a key."""
        return bool(self._keys)

    def identify(self, header: str | None) -> str | None:
        """The name of the tenant whose key an `Authorization: Bearer <key>` header carries, else None (a wrong
        key, or no key while keys are required). Without keys every client is the one anonymous tenant, ""."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, given = (header or "").partition(" ")
        try:
            # aiohttp hands header bytes that are not UTF-8 over as surrogate escapes: back to the client's bytes
            sent = given.strip().encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            sent = b""
        found = None
        for name, key in self._keys:
            if hmac.compare_digest(sent, key) and found is None:
                found = name
        return found if scheme.lower() == "bearer" else None

    def salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The cache salt a tenant's request carries: an HMAC of the node secret over the tenant's name and the
        client's own salt (if any), so a client can split its tenant's cache but never reach another's; None when
        salting is off or the proxy has no keys."""
        if self._secret is None or not self._keys:
            return client_salt
        message = tenant.encode() + b"\x00" + (client_salt or "").encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def client_salt_problem(value: Any) -> str | None:
    """Why a client's cache_salt would be refused by vLLM (a 400 here too), or None when it is fine."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return "cache_salt must be a non-empty string"
    if len(value) > SALT_MAX or _SALT_FORBIDDEN & set(value):
        return f"cache_salt must be at most {SALT_MAX} characters, none of @ / \\ or NUL"
    return None


def read_salt_secret(path: str | None) -> bytes:
    """The node secret tenant salts derive from: the file's contents, or (no file) a random one for this process,
    which changes every tenant's salt, and so empties the prefix cache's reach, at each proxy start."""
    if path is None:
        log.warning("no cache_salt_secret_file: tenants' cache salts derive from a secret of this process; they "
                    "change when the proxy restarts (pdctl up writes one in the state directory)")
        return secrets.token_bytes(32)
    p = Path(path)
    check_secret_file(p, "cache salt secret file")
    secret = p.read_bytes().strip()
    if len(secret) < 16:
        raise ConfigError(f"cache salt secret file {path} holds {len(secret)} bytes; it needs 16 or more",
                          fix="write a random secret into it (e.g. 32 bytes, base64), or unset it")
    return secret


def load_tenants(api_key_file: str | None, api_keys_file: str | None, per_key_salt: bool,
                 salt_secret_file: str | None, single_key: str | None) -> Tenants:
    """The proxy's tenants from its config: the single key (`api_key_file`, already read) as "default", plus
    every key of the keys file."""
    keys = read_keys(api_keys_file) if api_keys_file else {}
    if single_key is not None:
        if DEFAULT_TENANT in keys:
            raise ConfigError(f"API keys file {api_keys_file} names {DEFAULT_TENANT!r}, the name of api_key_file's "
                              "key", fix="rename it, or move that key into the keys file and unset api_key_file")
        if single_key in keys.values():
            raise ConfigError(f"api_key_file {api_key_file} holds a key of the API keys file {api_keys_file}")
        keys = {DEFAULT_TENANT: single_key, **keys}
    secret = read_salt_secret(salt_secret_file) if per_key_salt and keys else None
    return Tenants(keys, secret)
