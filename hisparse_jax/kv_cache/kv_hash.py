"""Chained hashes of full KV blocks: the keys of the prefix cache.

This module owns the one definition of a block's identity for prefix caching. A
block's hash covers its parent's hash, its `block_size` token ids and optional extra
keys (for example a model or adapter name), so equal hashes mean equal prefixes, not
merely equal blocks:

  tokens   [t0 .. t15][t16 .. t31][t32 .. t40]
  hashes   h0 = H(NONE_HASH, t0..t15, extra)
           h1 = H(h0, t16..t31, extra)
           (none: a partial block is never hashed, so it is never shared)

A request's `cache_salt` (vLLM's) enters the FIRST block's hash only, as its parent:
h0 = H(salted_root(salt), t0..t15, extra); the chain carries it to every later block, so
equal prompts under different salts (or one salted, one not) share no block, and equal
salts share as before. Without a salt the parent is NONE_HASH: hashes are unchanged.

Hashes are 128-bit BLAKE2b digests of the raw bytes, stable across processes (unlike
Python's `hash`), so a prefix seen by one engine process has the same key in another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = int

_DIGEST_SIZE = 16  # bytes; 128-bit hashes make an accidental collision negligible.

# Parent hash of the first block of every sequence (the chain's seed).
NONE_HASH: BlockHash = int.from_bytes(
    hashlib.blake2b(b"hisparse_jax/kv_hash", digest_size=_DIGEST_SIZE).digest(), "little")


def salted_root(cache_salt: str | None) -> BlockHash | None:
  """The parent hash of a salted sequence's first block; None (NONE_HASH) without a salt.
  A BLAKE2b of its own personalization, so it is never the hash of a block of tokens."""
  if cache_salt is None:
    return None
  h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=b"hisparse/salt")
  h.update(NONE_HASH.to_bytes(_DIGEST_SIZE, "little"))
  # (surrogatepass: a Python str may hold a lone surrogate; the encoding stays one-to-one)
  h.update(cache_salt.encode("utf-8", "surrogatepass"))
  return int.from_bytes(h.digest(), "little")


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
  """Hash of one full block, chained to `parent_hash` (None for the first block)."""
  parent = NONE_HASH if parent_hash is None else parent_hash
  h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
  h.update(parent.to_bytes(_DIGEST_SIZE, "little"))
  h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
  if extra_keys:
    h.update(repr(extra_keys).encode())
  return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple | None = None,
    parent_hash: BlockHash | None = None,
    *,
    cache_salt: str | None = None,
) -> list[BlockHash]:
  """Chained hashes of every full block of `token_ids`; a trailing partial block is skipped.
  `parent_hash`: the hash of the block before `token_ids[0]`, None when it is the first
  block, whose parent is then `salted_root(cache_salt)` (`cache_salt` only matters there)."""
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  if parent_hash is None:
    parent_hash = salted_root(cache_salt)
  hashes = []
  for start in range(0, len(token_ids) - block_size + 1, block_size):
    parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size], extra_keys)
    hashes.append(parent_hash)
  return hashes
