"""Tier keys: which stored bytes belong to which prefix, for which engine.

This module owns the identity of a block in the third tier (disk, remote). Two things
must match before stored bytes may be served:

  * the engine that wrote them: a `Namespace` names every property that changes the bytes
    of a block (model, dtype, block_size, per-block layout, shard, bytes per block). Its
    `digest()` is the SHA-256 of a canonical JSON, so it is the same in every process.
  * the prefix: keys are SHA-256 digests chained over each FULL block's token ids,
    seeded with the namespace digest:

      tokens   [t0 .. t15][t16 .. t31][t32 .. t40]
      keys     k0 = sha256(seed || int64le(t0..t15))      seed = bytes of namespace.digest()
               k1 = sha256(k0   || int64le(t16..t31))
               (none: a partial block is never keyed, so it is never stored)

A request's `cache_salt` (vLLM's) enters the first key only, through its seed:
seed = sha256("hisparse_jax/cache_salt\0" || namespace digest bytes || utf-8 salt); the
chain carries it on, so no tier serves one salt's blocks to another salt or to an
unsalted request. Without a salt the seed, and so every key, is as above.

Equal keys mean equal prefixes under equal namespaces (a 256-bit digest makes an
accidental collision negligible), across processes and machines: never Python's `hash`.
These keys are independent of kv_hash.py's (the in-memory prefix cache's), which may
change without invalidating stored tiers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np

KEY_NBYTES = 32  # a SHA-256 digest
_TOKEN_DTYPE = np.dtype("<i8")  # token ids hashed as little-endian int64, on every host
_SALT_DOMAIN = b"hisparse_jax/cache_salt\0"  # a salted seed's prefix (never a key's)


@dataclasses.dataclass(frozen=True)
class Namespace:
  """Everything that makes one engine's stored blocks unreadable by another.

  model: a model name or checkpoint digest; dtype: the cache's dtype ("bfloat16");
  kv_layout: the per-block array layout as the caller describes it ("k/v 30x[16,3,64]");
  shard: which slice of the cache this process holds ("tp0of1"); block_nbytes: bytes of
  one block's payload (every layer, K and V).
  """
  model: str
  dtype: str
  block_size: int
  kv_layout: str
  shard: str
  block_nbytes: int

  def __post_init__(self):
    if self.block_size <= 0:
      raise ValueError(f"Namespace.block_size must be positive, got {self.block_size}")
    if self.block_nbytes <= 0:
      raise ValueError(f"Namespace.block_nbytes must be positive, got {self.block_nbytes}")

  def to_json(self) -> str:
    """Canonical JSON (sorted keys, no spaces): the manifest's text and the digest's input."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Namespace:
    """The namespace of a manifest; ValueError when the text is not one."""
    try:
      fields = json.loads(text)
      return cls(**fields)
    except (TypeError, ValueError) as e:
      raise ValueError(f"not a namespace manifest: {e}") from None

  def digest(self) -> str:
    """SHA-256 hex of `to_json()`: the same in every process."""
    return hashlib.sha256(self.to_json().encode()).hexdigest()

  def differences(self, other: Namespace) -> list[str]:
    """'field mine vs theirs' for every field that differs (empty when equal)."""
    return [f"{f.name} {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)]


def chain_seed(namespace: Namespace, cache_salt: str | None = None) -> bytes:
  """The parent of the first block's key: the namespace digest's bytes, salted by a
  request's `cache_salt` when it has one."""
  seed = bytes.fromhex(namespace.digest())
  if cache_salt is None:
    return seed
  salt = cache_salt.encode("utf-8", "surrogatepass")  # (one-to-one, lone surrogates too)
  return hashlib.sha256(_SALT_DOMAIN + seed + salt).digest()


def chain_keys(token_ids: Sequence[int] | np.ndarray, block_size: int,
               namespace: Namespace, cache_salt: str | None = None) -> list[bytes]:
  """32-byte keys of every full block of `token_ids`, chained; a trailing partial block
  is skipped. `block_size` must equal the namespace's (it is passed to make call sites
  say which block size they key by). `cache_salt`: the request's, mixed into the first
  key (`chain_seed`); None keys as without one."""
  if block_size != namespace.block_size:
    raise ValueError(f"chain_keys: block_size {block_size} differs from the namespace's "
                     f"{namespace.block_size}")
  tokens = np.asarray(token_ids, dtype=_TOKEN_DTYPE)
  if tokens.ndim != 1:
    raise ValueError(f"chain_keys: token_ids must be 1-D, got shape {tokens.shape}")
  parent = chain_seed(namespace, cache_salt)
  keys = []
  for start in range(0, len(tokens) - block_size + 1, block_size):
    h = hashlib.sha256(parent)
    h.update(tokens[start:start + block_size].tobytes())
    parent = h.digest()
    keys.append(parent)
  return keys
