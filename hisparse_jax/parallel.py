"""Tensor parallelism: the engine's `jax.sharding.Mesh` and the shardings of its arrays.

One engine, one mesh of `tensor_parallel_size` devices over the axis
`models.sharding.TP_AXIS`; the weights are split as `models.sharding` says. The KV
cache is split by KV head, the block ids are not, so every device holds every block
(its own heads of it) and ONE block manager names blocks for all of them:

    pool.k[l] [num_blocks, block_size, num_kv_heads, head_dim]   P(None, None, tp, None)
    key bounds [rows, 2, num_kv_heads, head_dim]                 P(None, None, tp, None)
    hot-buffer state, step inputs / outputs                      replicated

`tensor_parallel_size == 1` is no mesh at all (None): the single-device engine, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.sharding import TP_AXIS

KV_HEADS = P(None, None, TP_AXIS, None)  # pages and key bounds: split by KV head


def make_mesh(tensor_parallel_size: int, devices: Iterable[jax.Device] | None = None
              ) -> Mesh | None:
  """The mesh of the first `tensor_parallel_size` devices (None for 1); ValueError naming
  the flag when there are fewer devices."""
  tp = tensor_parallel_size
  if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
    raise ValueError(f"--tensor_parallel_size must be a positive integer, got {tp!r}")
  if tp == 1:
    return None
  devices = list(devices) if devices is not None else jax.devices()
  if tp > len(devices):
    hint = (" (on CPU, make more first: XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{tp})" if devices[0].platform == "cpu" else "")
    raise ValueError(f"--tensor_parallel_size={tp} is larger than the {len(devices)} "
                     f"{devices[0].platform} devices jax sees{hint}")
  return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def tp_size(mesh: Mesh | None) -> int:
  return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def kv_sharding(mesh: Mesh, memory_kind: str) -> NamedSharding:
  return NamedSharding(mesh, KV_HEADS, memory_kind=memory_kind)


def replicated(mesh: Mesh, memory_kind: str) -> NamedSharding:
  return NamedSharding(mesh, P(), memory_kind=memory_kind)


def device_name(device: jax.Device) -> str:
  """`cpu:0`, `cuda:3`: the device label of the capacity lines and metrics."""
  return f"{device.platform}:{device.id}"


def live_bytes(arrays: Iterable[jax.Array]) -> dict[jax.Device, int]:
  """Bytes of the shards this process holds, by device (a replicated array counts once
  on every device that holds it)."""
  out: dict[jax.Device, int] = {}
  for array in arrays:
    for shard in array.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + int(shard.data.nbytes)
  return out
