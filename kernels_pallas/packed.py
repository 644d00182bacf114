"""Weights packed for the CPU matmul kernel: `PackedWeight`, `pack`, `matmul`.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so on a CPU
its time is the time to read the weights from memory. A row-major [K, N] matrix read a
column tile at a time (what a small-row matmul does to keep its accumulators in registers)
jumps a whole row between consecutive loads; packed as [N / T, K, T] panels (T = `TILE`
columns, row after row) each tile is one contiguous stretch that streams at the memory's
bandwidth. `cpu_matmul.cc` (built with the attention kernels, `cpu_kernels.available()`)
multiplies by the panels on XLA's thread pool; measured on the 2-core VM, 8 rows x a
[576, 1,536] float32 matrix: 2x XLA's dot, the tied [576, 49,152] logits projection 3.7x,
2,048 rows at par.

Every output element is sum_k x[m, k] w[k, n] in k order (fused multiply-adds), for any
number of rows: a sequence's logits do not depend on what else is in its batch.

`PackedWeight` multiplies like the [K, N] array it packs (`x @ w`: the model's `Linear`
takes it as its kernel); off CPU, or without the C++ kernels, `matmul` is an einsum over
the panels. Float32 only (what the kernel reads).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import cpu_kernels

TILE = 48  # panel width: 3 vectors of 16 float32 (8 rows x 3 vector accumulators)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A [K, N] float32 matrix as panels [ceil(N / TILE), K, TILE] (the last one zero-padded
  past column N). Multiplies like the matrix: `x @ w` is `matmul(x, w)`."""

  panels: jax.Array
  n: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    return (int(self.panels.shape[1]), self.n)

  @property
  def dtype(self):
    return self.panels.dtype

  ndim = 2

  def __getitem__(self, index):
    if index is Ellipsis:  # (nnx reads a parameter's value as param[...])
      return self
    raise TypeError("PackedWeight supports only [...]; unpack() gives the matrix")

  def __rmatmul__(self, x: jax.Array) -> jax.Array:
    return matmul(x, self)

  def unpack(self) -> jax.Array:
    """The [K, N] matrix."""
    tiles, k, t = self.panels.shape
    return self.panels.transpose(1, 0, 2).reshape(k, tiles * t)[:, :self.n]


def pack(w) -> PackedWeight:
  """`w` [K, N] (float32) as panels; a numpy matrix is packed on the host."""
  k, n = w.shape
  tiles = -(-n // TILE)
  if isinstance(w, np.ndarray):
    padded = np.zeros((k, tiles * TILE), w.dtype)
    padded[:, :n] = w
    return PackedWeight(jnp.asarray(padded.reshape(k, tiles, TILE).transpose(1, 0, 2).copy()), n)
  padded = jnp.pad(w, ((0, 0), (0, tiles * TILE - n)))
  return PackedWeight(padded.reshape(k, tiles, TILE).transpose(1, 0, 2), n)


@jax.jit
def _pack_device(w: jax.Array) -> jax.Array:
  return pack(w).panels


def pack_array(w: jax.Array) -> PackedWeight:
  """`pack` of a device array in one compiled program per shape (keeps its sharding)."""
  return PackedWeight(_pack_device(w), int(w.shape[1]))


def _einsum(x2, panels, n: int):
  y = jnp.einsum("mk,tkc->mtc", x2, panels, preferred_element_type=jnp.float32)
  return y.reshape(x2.shape[0], panels.shape[0] * panels.shape[2])[:, :n].astype(x2.dtype)


def matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
  """x [..., K] @ the matrix `w` packs: [..., N], float32. On CPU the C++ kernel (where
  built), elsewhere an einsum over the panels."""
  k, n = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"matmul: x has {x.shape[-1]} features, the weight {k}")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k).astype(jnp.float32)
  if w.dtype != jnp.float32 or not cpu_kernels.available():
    y = _einsum(x2, w.panels, n)
  else:
    call = jax.ffi.ffi_call(cpu_kernels.MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    y = lax.platform_dependent(x2, w.panels, cpu=lambda a, b: call(a, b),
                               default=lambda a, b: _einsum(a, b, n))
  return y.reshape(*lead, n)
