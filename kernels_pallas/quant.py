"""8-bit KV pages: quantization on write, dequantization on read (after the gather).

Layout (decided here), beside each K and V page array of a pool::

  values: int8    [num_blocks, block_size, num_kv_heads, head_dim]
          (fp8_e4m3: the float8_e4m3fn bits as uint8, since XLA:CPU computes in neither)
  scales: float32 [num_blocks, block_size, num_kv_heads, 1]      (one per token and KV head)
  x ~= values * scales,  scales = max|x| / 127 (int8) or / 448 (fp8_e4m3, its largest
  finite value) over the token's head_dim; int8 |error| <= scale / 2, fp8_e4m3 |error| <=
  |x| / 16 (3 mantissa bits, round to nearest) or scale / 1024 (subnormals)

Why one scale per token and KV head, not per block: decode writes a block one token at a
time, so a per-block scale would have to grow with later tokens and re-quantize the
tokens already stored (each re-quantization adds rounding error, and a reused block must
forget its old owner's scale). A per-token scale is fixed when the token is written, so
`write_kv` moves values and scales as it moves any page (the scales are pages of
head_dim 1), every block move (swap, write-through, HiSparse host loads, copy-on-write)
moves them like the values, and no block is ever re-read to be written. It costs 4 bytes
per token and KV head: at head_dim 32, 36 bytes against float32's 128 (3.56x).

Reads: `QuantizedPages` pairs the two arrays and behaves, for the attention code that
only gathers whole blocks (`pages[block_ids]`), like a float page array: the gather reads
int8 blocks and their scales and multiplies them, so only the blocks read are
dequantized (the xla attention, the jnp references and block_key_bounds' reference take
it as their pages). The Pallas kernels (Triton) take it too: they load the 8-bit blocks
and their scales through the block table (one byte per value from HBM) and dequantize
each loaded tile in registers, the same (values in float32 * scale) in the model dtype
(kernels_pallas.common.load_kv_blocks); fp8 converts with sm_89+ instructions. The Mosaic
GPU decode kernel (Hopper) TMA-copies the 8-bit blocks into shared memory and dequantizes
each step's tile there, the same way, before its WGMMA (kernels_pallas.paged_attention_mgpu).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127
FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (it has no inf: past it, NaN)
# The stored dtype of each quantized cache's values (fp8 as its bits: XLA:CPU has no fp8
# arithmetic, and the attention reads through QuantizedPages, which decodes them).
STORAGE_DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.uint8}


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., head_dim] -> (int8 values like x, float32 scales [..., 1]): symmetric, one
  scale per row, values in [-127, 127]; an all-zero row gets scale 0 and values 0."""
  x32 = x.astype(jnp.float32)
  scales = jnp.abs(x32).max(axis=-1, keepdims=True) / INT8_MAX
  safe = jnp.where(scales > 0, scales, 1.0)
  values = jnp.clip(jnp.round(x32 / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return values, scales


def quantize_fp8_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., head_dim] -> (float8_e4m3fn values as uint8 bits, float32 scales [..., 1]):
  each row scaled to max |x| = 448, rounded to nearest."""
  x32 = x.astype(jnp.float32)
  scales = jnp.abs(x32).max(axis=-1, keepdims=True) / FP8_E4M3_MAX
  safe = jnp.where(scales > 0, scales, 1.0)
  values = jnp.clip(x32 / safe, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
  return jax.lax.bitcast_convert_type(values, jnp.uint8), scales


def quantize(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
  """`quantize_int8` or `quantize_fp8_e4m3` (`kind`: a key of STORAGE_DTYPES)."""
  if kind == "int8":
    return quantize_int8(x)
  if kind == "fp8_e4m3":
    return quantize_fp8_e4m3(x)
  raise ValueError(f"quantized KV kind must be one of {tuple(STORAGE_DTYPES)}, got {kind!r}")


def kind_of(values_dtype) -> str:
  """The quantized cache kind whose values are stored as `values_dtype`."""
  for kind, dtype in STORAGE_DTYPES.items():
    if jnp.dtype(values_dtype) == jnp.dtype(dtype):
      return kind
  raise ValueError(f"no quantized KV stores its values as {values_dtype}")


def dequantize_int8(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """values * scales in `dtype` (computed in float32); uint8 values are fp8_e4m3 bits."""
  if values.dtype == jnp.uint8:
    values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
  return (values.astype(jnp.float32) * scales).astype(dtype)


dequantize = dequantize_int8  # either kind: the values' dtype says which


@jax.tree_util.register_pytree_node_class
class QuantizedPages:
  """8-bit pages (int8, or fp8_e4m3 bits as uint8) and their scales, read as pages of
  `dtype` (the model's dtype).

  Supports what the attention code does to pages: `.shape`, `.ndim`, `.dtype` and a
  gather of whole blocks along axis 0 (`pages[block_ids]`), which dequantizes the
  gathered blocks only.
  """

  def __init__(self, values: jax.Array, scales: jax.Array, dtype=jnp.float32):
    self.values = values  # int8 / uint8 [num_blocks, block_size, num_kv_heads, head_dim]
    self.scales = scales  # float32 [num_blocks, block_size, num_kv_heads, 1]
    self.dtype = jnp.dtype(dtype)

  def tree_flatten(self):
    return (self.values, self.scales), self.dtype

  @classmethod
  def tree_unflatten(cls, dtype, children):
    return cls(*children, dtype=dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  def __getitem__(self, block_ids) -> jax.Array:
    if isinstance(block_ids, tuple):
      raise TypeError("QuantizedPages supports a gather of whole blocks (axis 0) only")
    return dequantize_int8(self.values[block_ids], self.scales[block_ids], self.dtype)

  def dequantize(self) -> jax.Array:
    """Every block, as `dtype` pages (tests and references)."""
    return dequantize_int8(self.values, self.scales, self.dtype)
