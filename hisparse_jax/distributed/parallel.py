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

import math
import socket
import time
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


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           timeout_s: float = 60.0) -> None:
  """Multi-host: this process joins `num_processes` processes through
  `jax.distributed.initialize` (before anything else touches jax's backends). Every
  process then sees the devices of all (`jax.devices()`), the engine's mesh spans them,
  and each process holds its own devices' shards (its host pool in its host's memory).
  Every process runs the same deterministic scheduler on the same requests.

  ValueError naming the flag on bad input, and when no coordinator answers within
  `timeout_s` (checked before jax's own wait, which aborts the process instead of
  raising)."""
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"--num_processes must be >= 1, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id must be in [0, --num_processes={num_processes}), "
                     f"got {process_id!r}")
  if timeout_s <= 0:
    raise ValueError(f"--coordinator_timeout_s must be > 0, got {timeout_s}")
  host, _, port = (coordinator_address or "").rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"--coordinator_address must be HOST:PORT, got {coordinator_address!r}")
  if process_id != 0:  # process 0 starts the coordinator; the others must reach it
    _wait_for_coordinator(coordinator_address, host.strip("[]"), int(port), timeout_s)
  # CPU collectives across processes go through gloo (no effect on accelerators).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=max(1, int(math.ceil(timeout_s))))


def _wait_for_coordinator(address: str, host: str, port: int, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=1.0):
        return
    except OSError:
      if time.monotonic() >= deadline:
        raise ValueError(f"--coordinator_address={address}: no coordinator answered within "
                         f"{timeout_s:g} s (--coordinator_timeout_s)") from None
      time.sleep(0.2)
