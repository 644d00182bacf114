"""Tier keys and the stored payload: stable digests, the chain, verification of every field."""

import hashlib
import struct
import zlib

import numpy as np
import pytest

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys

NS = Namespace("smollm2-135m", "bfloat16", 4, "k/v 2x[4,1,8]", "tp0of1", 128)


def test_namespace_digest_and_keys_are_fixed_values():
  """The same hex in every process and on every host (never Python's salted hash)."""
  assert NS.to_json() == ('{"block_nbytes":128,"block_size":4,"dtype":"bfloat16",'
                          '"kv_layout":"k/v 2x[4,1,8]","model":"smollm2-135m",'
                          '"shard":"tp0of1"}')
  assert NS.digest() == "2fdc69d7abc3a05be35f0b61d9126f241b9144efdc35ac94a4a228e84d034ead"
  keys = chain_keys(list(range(10)), 4, NS)
  assert [k.hex() for k in keys] == [
    "97be4ffb49248cd9d0275da048dd4e03e39da57a30f943149c503e99fd8b0e24",
    "44377147b912f259acbaf0fa4ccc4b4cc2f9deff6fb89592ffcf2f0be0d1b9bc",
  ]
  # The definition: sha256(parent || int64le tokens), seeded with the namespace digest.
  k0 = hashlib.sha256(bytes.fromhex(NS.digest()) + np.arange(4, dtype="<i8").tobytes())
  assert keys[0] == k0.digest()
  assert keys[1] == hashlib.sha256(keys[0] + struct.pack("<4q", 4, 5, 6, 7)).digest()
  assert Namespace.from_json(NS.to_json()) == NS


def test_chain_property_and_partial_block():
  a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, NS)
  b = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44, 45], 4, NS)
  assert len(a) == 2  # token 9 is a partial block: never keyed
  assert b[:2] == a and len(b) == 3
  # The same block after a different prefix is a different key.
  c = chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, NS)
  assert c[1] != a[1]
  assert chain_keys([1, 2, 3], 4, NS) == []
  assert chain_keys(np.array([1, 2, 3, 4], np.int32), 4, NS) == a[:1]  # dtype-independent


def test_every_namespace_field_changes_every_key():
  base = chain_keys(range(8), 4, NS)
  for field, value in [("model", "other"), ("dtype", "float16"), ("kv_layout", "k/v 3x"),
                       ("shard", "tp1of2"), ("block_nbytes", 256)]:
    other = Namespace(**{**NS.__dict__, field: value})
    assert other.differences(NS) == [f"{field} {value!r} vs {getattr(NS, field)!r}"]
    keys = chain_keys(range(8), 4, other)
    assert all(k != b for k, b in zip(keys, base)), field
  with pytest.raises(ValueError, match="block_size 8 differs"):
    chain_keys(range(8), 8, NS)


def test_payload_round_trip_and_layout():
  digest, key = bytes.fromhex(NS.digest()), chain_keys(range(4), 4, NS)[0]
  data = np.arange(128, dtype=np.uint8)
  blob = payload.encode(digest, key, data)
  assert len(blob) == payload.stored_nbytes(128) == 80 + 128 + 4
  assert blob[:4] == b"HSKV" and blob[8:40] == digest and blob[40:72] == key
  assert struct.unpack_from("<Q", blob, 72) == (128,)
  assert struct.unpack_from("<I", blob, 208) == (zlib.crc32(blob[:208]),)
  assert bytes(payload.decode(blob, digest, key, 128)) == data.tobytes()


@pytest.mark.parametrize("mutate, reason", [
  (lambda b: b[:-1], "truncated"),
  (lambda b: b[:50], "truncated"),
  (lambda b: b"XXXX" + b[4:], "bad magic"),
  (lambda b: b[:4] + b"\x02" + b[5:], "format version 2"),
  (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum mismatch"),
  (lambda b: b[:-4] + b"\0\0\0\0", "checksum mismatch"),
  (lambda b: b + b"\0", "truncated"),
])
def test_payload_rejects_every_damage(mutate, reason):
  digest, key = bytes.fromhex(NS.digest()), chain_keys(range(4), 4, NS)[0]
  blob = payload.encode(digest, key, np.zeros(128, np.uint8))
  with pytest.raises(payload.CorruptPayload, match=reason):
    payload.decode(mutate(blob), digest, key, 128)


def test_payload_rejects_another_key_namespace_or_size():
  digest, (k0, k1) = bytes.fromhex(NS.digest()), chain_keys(range(8), 4, NS)
  blob = payload.encode(digest, k0, np.zeros(128, np.uint8))
  with pytest.raises(payload.CorruptPayload, match="key differs"):
    payload.decode(blob, digest, k1, 128)
  with pytest.raises(payload.CorruptPayload, match="namespace digest differs"):
    payload.decode(blob, bytes(32), k0, 128)
  with pytest.raises(payload.CorruptPayload, match="payload length 128, expected 64"):
    payload.decode(blob, digest, k0, 64)


def test_public_names_of_the_package():
  import hisparse_jax.kv_cache.tiers as tiers
  from hisparse_jax.kv_cache.tiers.disk import DiskBackend
  from hisparse_jax.kv_cache.tiers.tier import KVTier
  assert tiers.KVTier is KVTier and tiers.DiskBackend is DiskBackend
  assert tiers.chain_keys is chain_keys and issubclass(tiers.TierError, ValueError)
  assert sorted(tiers.__all__) == sorted([
    "Namespace", "chain_keys", "KVTier", "LookupResult", "TierJob", "TierError", "BlockIO",
    "Backend", "DiskBackend", "RemoteBackend"])
