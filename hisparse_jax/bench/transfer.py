"""Suite `transfer`: TransferEngine block moves against a numpy copy of the same bytes.

For several block sizes and block counts N, in one run, interleaved:

    h2d  TransferEngine.swap_in(host_ids, device_ids)    vs  dst[device_ids] = src[host_ids]
    d2h  TransferEngine.swap_out(device_ids, host_ids)   vs  dst[host_ids] = src[device_ids]
         (N random distinct blocks, every layer, K and V: one jitted call per direction)

The numpy side is a fancy-index gather + scatter over per-layer numpy arrays of the same
shapes, so both sides move the same bytes between random block positions. JSON ratios
`h2d_vs_memcpy` / `d2h_vs_memcpy` = numpy time / engine time (1.0: as fast as numpy;
the goal on CPU is >= 0.8), the geometric mean over cases, each case also listed. `profile`
times the stages of one array's h2d move alone: GPU's three (host gather, crossing, scatter)
and CPU's one (block copies, transfer.copy_block_loop). On a
GPU each row also gives GB/s and the fraction of the PCIe peak of the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.kv_cache import host_compute
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool
from hisparse_jax.kv_cache.transfer import HOST_COPIES, TransferEngine, copy_block_loop

# Host <-> device peak of one direction (bytes/s) by device_kind prefix: PCIe 5.0 x16
# for Hopper, 4.0 x16 for A100 / L4 (vendor datasheets).
PCIE_PEAK_BYTES_PER_S = {
    "NVIDIA H200": 64e9,
    "NVIDIA H100": 64e9,
    "NVIDIA A100": 32e9,
    "NVIDIA L4": 32e9,
}


@dataclasses.dataclass(frozen=True)
class Size:
  block_sizes: tuple[int, ...]
  num_blocks: tuple[int, ...]  # blocks moved per call (powers of two: no bucket padding)
  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  reps: int


SIZES = {
    # 8 KiB per token: 128 KiB (block 16) to 512 KiB (block 64) per block, 2-128 MiB a call.
    "full": Size((16, 64), (16, 64, 256), num_layers=4, num_kv_heads=2, head_dim=128,
                 dtype="float32", reps=7),
    "smoke": Size((8,), (8, 16), num_layers=2, num_kv_heads=2, head_dim=16,
                  dtype="float32", reps=2),
}


def pcie_peak() -> float | None:
  """The host <-> device peak of one direction of this machine's first device (None: not a
  GPU, or one not in PCIE_PEAK_BYTES_PER_S)."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return None
  return next((peak for prefix, peak in PCIE_PEAK_BYTES_PER_S.items()
               if device.device_kind.startswith(prefix)), None)


def case(spec: KVCacheSpec, num_moved: int, reps: int, rng: np.random.Generator,
         with_numpy: bool = True, one_memory: bool | None = None,
         host_copy: str | None = None) -> list[dict]:
  """Both directions for N = `num_moved` blocks: engine and numpy, interleaved (without
  numpy: the engine alone, its ratio fields None; the pools hold zeros, which move as
  fast as any bytes: what the GPU bench's 8B-class layout times). one_memory, host_copy:
  the TransferEngine's (None: as this machine's devices are; the env var)."""
  num_pool_blocks = 2 * num_moved + 1  # null block + room for distinct random ids
  device_pool = KVPool(spec, num_pool_blocks, DEVICE)
  host_pool = KVPool(spec, num_pool_blocks, PINNED_HOST)
  engine = TransferEngine(device_pool, host_pool, one_memory=one_memory, host_copy=host_copy)
  shape = spec.block_shape(num_pool_blocks)
  arrays = 2 * spec.num_layers if with_numpy else 0
  np_device = [rng.standard_normal(shape).astype(spec.dtype) for _ in range(arrays)]
  np_host = [rng.standard_normal(shape).astype(spec.dtype) for _ in range(arrays)]
  device_ids = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)
  host_ids = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)

  def numpy_copy(src_arrays, dst_arrays, src_ids, dst_ids):
    for src, dst in zip(src_arrays, dst_arrays):
      dst[dst_ids] = src[src_ids]

  def engine_h2d():
    engine.swap_in(host_ids, device_ids)
    engine.wait()
    return device_pool.arrays()

  def engine_d2h():
    engine.swap_out(device_ids, host_ids)
    engine.wait()
    return host_pool.arrays()

  thunks = {"h2d": engine_h2d, "d2h": engine_d2h}
  if with_numpy:
    thunks["h2d_numpy"] = lambda: numpy_copy(np_host, np_device, host_ids, device_ids)
    thunks["d2h_numpy"] = lambda: numpy_copy(np_device, np_host, device_ids, host_ids)
  times = common.interleaved(thunks, reps)
  nbytes = num_moved * spec.bytes_per_block
  peak = pcie_peak()
  rows = []
  for direction in ("h2d", "d2h"):
    engine_s = common.median(times[direction])
    numpy_s = common.median(times[direction + "_numpy"]) if with_numpy else None
    rows.append({
        "direction": direction, "block_size": spec.block_size, "num_blocks": num_moved,
        "bytes": nbytes, "engine_ms": engine_s * 1e3,
        "numpy_ms": None if numpy_s is None else numpy_s * 1e3,
        "ratio_vs_memcpy": None if numpy_s is None else numpy_s / engine_s,
        "engine_gb_per_s": nbytes / engine_s / 1e9,
        "numpy_gb_per_s": None if numpy_s is None else nbytes / numpy_s / 1e9,
        "pcie_fraction": None if peak is None else nbytes / engine_s / peak})
  return rows


def kernel_check(spec: KVCacheSpec, num_moved: int, rng: np.random.Generator) -> dict:
  """The host <-> device paths against numpy, bit for bit: pools of random bytes (NaN
  patterns included), `num_moved` random blocks swapped in, then other blocks swapped
  out, by the XLA path and by the zero-copy kernel (`one_memory=False`: the GPU's
  mechanisms, forced on a CPU); returns, for each host_copy, the number of blocks (of
  every array, both pools) that differ from numpy's fancy-index copies."""
  num_pool_blocks = 2 * num_moved + 1
  probe = KVPool(spec, num_pool_blocks, DEVICE)
  start = [[np.frombuffer(rng.bytes(a.size * a.dtype.itemsize), a.dtype).reshape(a.shape)
            for a in probe.arrays()] for _ in range(2)]  # device's, host's
  del probe
  in_host = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)
  in_device = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)
  out_device = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)
  out_host = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False)
  want_device = [a.copy() for a in start[0]]
  want_host = [a.copy() for a in start[1]]
  for d, h in zip(want_device, want_host):
    d[in_device] = h[in_host]
    h[out_host] = d[out_device]
  differing = {}
  for host_copy in HOST_COPIES:
    pools = [KVPool(spec, num_pool_blocks, kind) for kind in (DEVICE, PINNED_HOST)]
    for pool, arrays in zip(pools, start):
      pool.set_arrays(tuple(jax.device_put(x, a.sharding)
                            for x, a in zip(arrays, pool.arrays())))
    engine = TransferEngine(*pools, one_memory=False, host_copy=host_copy)
    engine.swap_in(in_host, in_device)
    engine.swap_out(out_device, out_host)
    engine.wait()
    got = [np.asarray(a) for pool in pools for a in pool.arrays()]
    differing[host_copy] = sum(
        int((g.reshape(len(g), -1).view(np.uint8) != w.reshape(len(w), -1).view(np.uint8))
            .any(axis=1).sum())
        for g, w in zip(got, want_device + want_host))
  return differing


def _profile_h2d(spec: KVCacheSpec, num_moved: int, reps: int, rng: np.random.Generator
                 ) -> list[dict]:
  """The stages of an h2d move of one K (or V) array, each jitted and timed alone, against
  numpy's gather + scatter of the same array: where the time of a transfer goes."""
  num_pool_blocks = 2 * num_moved + 1
  shape = spec.block_shape(num_pool_blocks)
  device = jax.devices()[0]
  on_device = jax.sharding.make_single_device_sharding(device, memory_kind=DEVICE)
  on_host = jax.sharding.make_single_device_sharding(device, memory_kind=PINNED_HOST)
  src = np.arange(1, num_moved + 1, dtype=np.int32)
  dst = rng.choice(np.arange(1, num_pool_blocks), num_moved, replace=False).astype(np.int32)
  host_array = jax.jit(lambda: jax.device_put(jnp.ones(shape, spec.dtype), on_host))()
  host_ids = jax.device_put(src, on_host)

  def host_gather(pool, ids):
    return host_compute.on_host(lambda p, i: p[i])(pool, ids)

  gather = jax.jit(host_gather, out_shardings=on_host)
  to_device = jax.jit(lambda x: jax.device_put(x, on_device))
  scatter = jax.jit(lambda pool, ids, x: pool.at[ids].set(x, mode="drop"), donate_argnums=0)
  blocks_host = gather(host_array, host_ids)
  blocks_device = to_device(blocks_host)
  pool = [jax.jit(lambda: jnp.zeros(shape, spec.dtype), out_shardings=on_device)()]

  def scatter_step():
    pool[0] = scatter(pool[0], dst, blocks_device)
    return pool[0]

  count = jnp.int32(num_moved)
  loop = jax.jit(lambda src_pool, pool, src_ids, ids: copy_block_loop(
      [jax.device_put(src_pool, on_device)], [pool], src_ids, ids, count)[0],
      donate_argnums=1)

  def loop_step():
    pool[0] = loop(host_array, pool[0], src, dst)
    return pool[0]

  np_src, np_dst = np.ones(shape, spec.dtype), np.zeros(shape, spec.dtype)

  def numpy_copy():
    np_dst[dst] = np_src[src]

  times = common.interleaved({
      "gather on the host (compute_on device_host)": lambda: gather(host_array, host_ids),
      "copy pinned_host -> device memory kind": lambda: to_device(blocks_host),
      "scatter into the device pool (donated)": scatter_step,
      "the three above are GPU's path; CPU's: block copies (hop-free)": loop_step,
      "numpy gather + scatter": numpy_copy}, reps)
  return [{"stage": name, "ms_per_array": common.median(t) * 1e3,
           "arrays_per_move": 2 * spec.num_layers} for name, t in times.items()]


def run(size_name: str = "full", seed: int = 0) -> dict:
  size = SIZES[size_name]
  rng = np.random.default_rng(seed)
  rows = []
  for block_size in size.block_sizes:
    spec = KVCacheSpec(num_layers=size.num_layers, num_kv_heads=size.num_kv_heads,
                       head_dim=size.head_dim, dtype=size.dtype, block_size=block_size)
    for num_moved in size.num_blocks:
      rows += case(spec, num_moved, size.reps, rng)
  profile = _profile_h2d(spec, max(size.num_blocks), size.reps, rng)  # the largest case
  ratios = {d: [r["ratio_vs_memcpy"] for r in rows if r["direction"] == d]
            for d in ("h2d", "d2h")}
  return {
      "h2d_vs_memcpy": common.geomean(ratios["h2d"]),
      "d2h_vs_memcpy": common.geomean(ratios["d2h"]),
      "h2d_vs_memcpy_min": min(ratios["h2d"]), "d2h_vs_memcpy_min": min(ratios["d2h"]),
      "goal_cpu": 0.8, "pcie_peak_bytes_per_s": pcie_peak(), "config": dataclasses.asdict(size),
      "ratio": "numpy fancy-index copy time / TransferEngine time (medians, interleaved); "
               "the top-level figures are geometric means over the rows",
      "rows": rows, "profile_case": {"block_size": spec.block_size,
                                     "num_blocks": max(size.num_blocks)},
      "profile": profile}


def format_table(result: dict) -> str:
  rows = [(r["direction"], r["block_size"], r["num_blocks"], f"{r['bytes'] / 2**20:.1f}",
           r["engine_ms"], r["numpy_ms"], r["ratio_vs_memcpy"], r["engine_gb_per_s"],
           "-" if r["pcie_fraction"] is None else f"{100 * r['pcie_fraction']:.1f}")
          for r in result["rows"]]
  table = common.format_table(["dir", "block", "N", "MiB", "engine ms", "numpy ms",
                               "numpy/engine", "GB/s", "PCIe %"], rows)
  case = result["profile_case"]
  profile = common.format_table(
      [f"h2d of one array, block {case['block_size']}, N {case['num_blocks']}", "ms"],
      [(p["stage"], p["ms_per_array"]) for p in result["profile"]])
  return (f"{table}\n{profile}\nh2d_vs_memcpy {result['h2d_vs_memcpy']:.2f}  d2h_vs_memcpy "
          f"{result['d2h_vs_memcpy']:.2f}  (geometric means; goal on CPU >= 0.8)")
