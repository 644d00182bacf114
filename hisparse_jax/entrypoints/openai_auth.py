"""The OpenAI server's API keys: which bearer keys it takes, and the cache salt of each.

A server shared by tenants gives each its own key (serve's `--api_key=K1,K2` and / or
`--api_keys_file`, one key a line). With `--cache_salt_by_api_key` every request's cache
salt comes from its key, so two tenants share no cached KV (prefix cache, host pool,
disk and remote tiers: the salt seeds every block hash and tier key), while one
tenant's repeated prompt still hits:

    key salt        = "key-" + hex(SHA-256("hisparse_jax/api_key\\0" || key))[:32]
    effective salt  = key salt                          (the body has no cache_salt)
                    = key salt + ":" + body cache_salt  (it has one)

The key salt has one length, so (key, body salt) -> effective salt is one-to-one: no
body salt of one tenant names another tenant's salt. The engine sees only the digest,
never the key (nor do its logs and metrics); the digest is the same in every process,
so replicas that share a disk or remote tier share one tenant's blocks.

A key is a word of printable ASCII (no spaces, as an `Authorization: Bearer KEY` header
carries it). A presented key is looked up by its own SHA-256, so the check does not
compare the key's bytes one by one (no early exit that times a prefix).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

_SALT_DOMAIN = b"hisparse_jax/api_key\0"  # (a salt digest is never a plain key digest)
_BEARER = "Bearer "


def key_problem(key: str) -> str | None:
  """Why `key` cannot be an API key (None: it can): empty, or a character outside
  printable ASCII or a space (which an Authorization header cannot carry as one word)."""
  if not key:
    return "is empty"
  if not all("!" <= c <= "~" for c in key):
    return "has a space or a character outside printable ASCII"
  return None


def _digest(key: str) -> bytes:
  # (surrogatepass: a header or query string decodes to any str; the lookup never raises)
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
  """The bearer keys a server accepts, each mapped to its key salt (module docstring).

  Invariants: at least one key; each passes `key_problem`; only the keys' digests are
  kept (a lookup table of digest -> key salt), never their text."""

  def __init__(self, keys: Iterable[str]):
    if isinstance(keys, str):  # (its characters would each become a key)
      raise TypeError("API keys must be a list of keys, got one str")
    self._salts: dict[bytes, str] = {}
    for i, key in enumerate(keys):
      if (problem := key_problem(key)) is not None:
        raise ValueError(f"API key {i + 1} {problem}")
      salt = hashlib.sha256(_SALT_DOMAIN + key.encode()).hexdigest()[:32]
      self._salts[_digest(key)] = f"key-{salt}"
    if not self._salts:
      raise ValueError("no API key given")

  def __len__(self) -> int:
    return len(self._salts)

  def key_salt(self, key: str | None) -> str | None:
    """The key salt of `key` when it is one of the keys, else None (not a key)."""
    return None if key is None else self._salts.get(_digest(key))

  def bearer_salt(self, authorization: str | None) -> str | None:
    """The key salt of an `Authorization: Bearer KEY` header's key, else None."""
    if authorization is None or not authorization.startswith(_BEARER):
      return None
    return self.key_salt(authorization[len(_BEARER):])


def cache_salt(key_salt: str, body_salt: str | None) -> str:
  """The effective cache salt of a request under `--cache_salt_by_api_key`: its key's
  salt, joined to the body's own cache_salt when it has one."""
  return key_salt if body_salt is None else f"{key_salt}:{body_salt}"


def keys_from_flags(api_key: str | None, api_keys_file: str | None) -> list[str]:
  """serve's keys: `--api_key`'s comma-separated keys (spaces around each dropped), then
  `--api_keys_file`'s lines (one key a line; blank lines and lines starting with # are
  skipped; a UTF-8 BOM and CRLF endings are read as a text editor writes them). Bad
  input is a ValueError naming the flag (and the line): an empty key, a key an
  Authorization header cannot carry, a file that cannot be read or holds no key."""
  keys = []
  if api_key is not None:
    for i, key in enumerate(api_key.split(",")):
      key = key.strip()
      if (problem := key_problem(key)) is not None:
        where = f"key {i + 1}" if "," in api_key else "the key"
        raise ValueError(f"--api_key: {where} {problem} (give KEY or KEY1,KEY2,...)")
      keys.append(key)
  if api_keys_file is not None:
    try:
      with open(api_keys_file, encoding="utf-8-sig") as f:
        lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--api_keys_file: cannot read {api_keys_file}: "
                       f"{getattr(e, 'strerror', None) or e}") from None
    found = 0
    for number, line in enumerate(lines, 1):
      key = line.strip()
      if not key or key.startswith("#"):
        continue
      if (problem := key_problem(key)) is not None:
        raise ValueError(f"--api_keys_file: {api_keys_file} line {number}: the key {problem}")
      keys.append(key)
      found += 1
    if not found:
      raise ValueError(f"--api_keys_file: {api_keys_file} holds no key (one key a line; "
                       "blank lines and # comments are skipped)")
  return keys
