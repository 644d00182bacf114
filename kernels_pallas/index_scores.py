"""DSA's lightning-indexer scores, read in place: every query token's score of every key
its row's block table lists, from the paged indexer keys (and, for a tiered row, the
device copy of its dropped blocks' keys), with no gathered copy of the keys.

  score[t, p] = sum_h w[t, h] * relu(q[t, h] . k[p] * dim**-0.5)
  k[p] = index_pages[tables[t, p // bs], p % bs]          where tables[t, p // bs] != 0
       = host_index[host_tables[t, p // bs], p % bs]      else (with host_index)

  grid (tokens, cdiv(width, blocks_per_program)): program (t, j) gathers its blocks' keys
  through token t's table ([keys, width], each key read from the one array that holds
  it: masked loads) and writes their scores with one dot ([heads, width] x [width, keys],
  float32 accumulation), relu and the weighted sum over heads.

Why a kernel (#54: the select at 64k a small part of the step; DSA's select is this
indexer and a top-k). The jnp path (hisparse_jax.sparse.dsa_attention.select, the CPU's)
gathers each token's keys ([tokens, width x bs, dim]; and the host copy's, then a where)
and scores them with float32 einsums, a few tokens at a time to bound the gathered bytes:
at DeepSeek-V3.2's indexer (64 heads of 128, bf16 keys) and 64k tokens a decode row's keys
are 16 MiB, so its tiles hold ONE token and a batch of 32 decode rows is 32 trips of a
loop, each writing and re-reading 16-32 MiB of gathered keys. The kernel reads each key
once per query token (the bytes the indexer needs), its dot in bf16 on tensor cores when
q and the keys are bf16 (exact products, float32 sums; float32 at IEEE precision
otherwise), every token of a tile in one launch.

8-bit keys (the engine's `index_cache_dtype` int8 / fp8_e4m3; DeepSeek-V3.2's reference
indexer and vLLM cache these keys in fp8 with a float32 scale per token): index_pages and
host_index as `kernels_pallas.quant.QuantizedPages`,

  values int8 [blocks, block_size, 1, dim] (fp8_e4m3: its bits as uint8, quant.quantize)
  scales float32 [blocks, block_size, 1, 1]            k[p] = values[p] * scales[p]

The kernel loads its blocks' values through the table with the same masked loads (one
byte a value from HBM), converts them exactly to the dot's dtype (-127..127 and every
float8_e4m3fn are bfloat16 and float16 numbers; fp8 converts with sm_89+ instructions,
fine on H100 / H200), does the same one dot (16-bit q: exact products on tensor cores,
float32 sums; float32 q: float32 dots), and multiplies each key's column by its scale
(loaded through the table, masked like the values) before the dim**-0.5 and the relu:
the score of the dequantized keys, up to the order of float32 roundings. Why: the select
reads the keys' bytes, and at dim 128 a token's key is 256 B in bfloat16 against 128 + 4
= 132 B in 8 bits: at DeepSeek-V3.2's indexer, 64k tokens and 32 decode rows, 512 MiB a
step against 264 MiB (~0.11 ms against ~0.06 at 4.8 TB/s, H200 HBM).

Limits: index_q [tokens, heads, dim], index_w float32 [tokens, heads]; index_pages and
host_index [blocks, block_size, 1, dim] (the engine's `index_k` pools) in float32,
bfloat16, float16 or uint16 (bfloat16 bits: the CPU's storage), or both 8-bit
(QuantizedPages of one kind, never one 8-bit and one float); tables / host_tables int32
[tokens, width] (each token's row's), in range. A dim that is not a power of 2 is tiled
at the next one, its padding masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common, quant
from kernels_pallas.quant import QuantizedPages

KEYS_PER_PROGRAM = 256  # keys a program scores (blocks_per_program = this // block_size)


def _index_scores_kernel(q_ref, w_ref, dev_ref, host_ref, *refs, dim: int, has_host: bool,
                         dot_dtype, quantized: bool = False):
  """q [heads_pad, width] (zero rows past the heads), w [heads_pad] float32 (zeros past
  them), dev / host pages [blocks, block_size, width] (8-bit values when `quantized`, then
  dev / host scales [blocks, block_size, 1] first in `refs`), ids [blocks_per_program];
  out [blocks_per_program * block_size] float32."""
  if quantized:
    dev_scales_ref, host_scales_ref, dev_ids_ref, host_ids_ref, out_ref = refs
  else:
    dev_ids_ref, host_ids_ref, out_ref = refs
  ids = dev_ids_ref[...]
  keys_n = out_ref.shape[0]
  if has_host:  # each key from the one array that holds it: the other's load gives 0, so
    # the sum is exact (8-bit values: the bits of one, int8 or fp8_e4m3's +0 added to them)
    host_ids = host_ids_ref[...]
    keys = (common.load_blocks(dev_ref, ids, dim, ids != 0)
            + common.load_blocks(host_ref, host_ids, dim, ids == 0))
  else:
    keys = common.load_blocks(dev_ref, ids, dim)
  keys = keys.reshape(keys_n, keys.shape[-1])
  if quantized and keys.dtype == jnp.uint8:  # fp8_e4m3 bits (sm_89+ converts them)
    keys = lax.bitcast_convert_type(keys, jnp.float8_e4m3fn)
  # (8-bit values convert exactly: -127..127 and every float8_e4m3fn are bf16 / f16 numbers)
  keys = keys.astype(dot_dtype)
  s = jnp.dot(q_ref[...], keys.T, precision=lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)  # [heads_pad, keys]
  if quantized:  # each key's scale on its column: the dot of q with values * scale
    if has_host:
      scales = (common.load_blocks(dev_scales_ref, ids, 1, ids != 0)
                + common.load_blocks(host_scales_ref, host_ids, 1, ids == 0))
    else:
      scales = common.load_blocks(dev_scales_ref, ids, 1)
    s = s * scales.reshape(1, keys_n)
  s = jnp.maximum(s * dim**-0.5, 0.0)
  out_ref[...] = (w_ref[...][:, None] * s).sum(axis=0)


def _bits(x):
  return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def _check(index_q, index_w, index_pages, tables, host_index, host_tables):
  tokens, heads, dim = index_q.shape
  if index_w.shape != (tokens, heads):
    raise ValueError(f"index_w must be [tokens={tokens}, heads={heads}], got {index_w.shape}")
  if host_index is not None and (isinstance(index_pages, QuantizedPages)
                                 != isinstance(host_index, QuantizedPages)):
    raise ValueError("index_pages and host_index must both be 8-bit (QuantizedPages) or both "
                     f"float pages, got {type(index_pages).__name__} and "
                     f"{type(host_index).__name__}")
  if isinstance(host_index, QuantizedPages) and (
      host_index.values.dtype != index_pages.values.dtype):
    raise ValueError("index_pages and host_index must store one 8-bit kind, got "
                     f"{index_pages.values.dtype} and {host_index.values.dtype} values")
  for name, pages in (("index_pages", index_pages), ("host_index", host_index)):
    if pages is not None and (pages.ndim != 4 or pages.shape[2] != 1 or pages.shape[3] != dim):
      raise ValueError(f"{name} must be [blocks, block_size, 1, dim={dim}], got {pages.shape}")
    if isinstance(pages, QuantizedPages) and (
        pages.values.dtype not in (jnp.int8, jnp.uint8) or pages.scales.dtype != jnp.float32
        or pages.scales.shape != (*pages.shape[:2], 1, 1)):
      raise ValueError(f"{name} (QuantizedPages) must be int8 or uint8 (fp8_e4m3 bits) values "
                       f"and float32 scales [blocks, block_size, 1, 1] = "
                       f"{(*pages.shape[:2], 1, 1)}, got {pages.values.dtype} and "
                       f"{pages.scales.dtype} {pages.scales.shape}")
  if tables.ndim != 2 or tables.shape[0] != tokens:
    raise ValueError(f"tables must be [tokens={tokens}, width], got {tables.shape}")
  if (host_index is None) != (host_tables is None) or (
      host_tables is not None and host_tables.shape != tables.shape):
    raise ValueError("host_index and host_tables go together, host_tables shaped as tables "
                     f"{tables.shape}")


def index_scores(index_q: jax.Array, index_w: jax.Array,
                 index_pages: jax.Array | QuantizedPages, tables: jax.Array,
                 host_index: jax.Array | QuantizedPages | None = None,
                 host_tables: jax.Array | None = None, *, interpret: bool | None = None,
                 keys_per_program: int = KEYS_PER_PROGRAM) -> jax.Array:
  """float32 [tokens, width * block_size]: the indexer's score of every listed key (module
  docstring), what `index_scores_reference` computes, the keys read where they lie.
  `interpret` None: compiled for a GPU where traced for one (this process's GPU or an
  abstract GPU context: a deviceless build), interpret mode on CPU."""
  _check(index_q, index_w, index_pages, tables, host_index, host_tables)
  if interpret is None:  # (resolved outside the jit: its cache does not see the context)
    interpret = backend.context_platform() == "cpu"
  return _index_scores(index_q, index_w, index_pages, tables, host_index, host_tables,
                       interpret=bool(interpret), keys_per_program=keys_per_program)


@functools.partial(jax.jit, static_argnames=("interpret", "keys_per_program"))
def _index_scores(index_q, index_w, index_pages, tables, host_index, host_tables, *,
                  interpret: bool, keys_per_program: int):
  tokens, heads, dim = index_q.shape
  has_host = host_index is not None
  quantized = isinstance(index_pages, QuantizedPages)
  scales = ()
  if quantized:  # the 8-bit values through the pages' specs, the scales through their own
    scales = (index_pages.scales, (host_index if has_host else index_pages).scales)
    index_pages = index_pages.values
    host_index = host_index.values if has_host else None
  index_pages = _bits(index_pages)
  host_index = _bits(host_index) if has_host else index_pages
  host_tables = host_tables if has_host else tables
  block_size = index_pages.shape[1]
  width = tables.shape[1]
  min_rows = backend.min_dot_rows(interpret)
  if quantized:  # 16-bit q: the values convert to its dtype exactly (tensor-core dots)
    dot_dtype = index_q.dtype if jnp.dtype(index_q.dtype).itemsize == 2 else jnp.float32
  else:
    dot_dtype = (index_q.dtype if index_q.dtype == index_pages.dtype == host_index.dtype
                 and jnp.dtype(index_q.dtype).itemsize == 2 else jnp.float32)
  padded_dim = common.padded_head_dim(dim, min_rows)
  heads_pad = common.next_power_of_2(max(heads, min_rows))
  per_program = max(1, min(keys_per_program // block_size,
                           common.next_power_of_2(max(width, min_rows // block_size or 1))))
  backend.check_triton_sizes(interpret, block_size=block_size, blocks_per_program=per_program)
  tiles = common.cdiv(width, per_program)
  pad = ((0, 0), (0, tiles * per_program - width))
  q = jnp.pad(index_q.astype(dot_dtype),
              ((0, 0), (0, heads_pad - heads), (0, padded_dim - dim)))
  w = jnp.pad(index_w.astype(jnp.float32), ((0, 0), (0, heads_pad - heads)))
  pages_spec = lambda p, cols=padded_dim: pl.BlockSpec(  # noqa: E731
      (p.shape[0], block_size, None, cols), lambda t, j: (0, 0, 0, 0))
  ids_spec = pl.BlockSpec((None, per_program), lambda t, j: (t, j))
  out = pl.pallas_call(
      functools.partial(_index_scores_kernel, dim=dim, has_host=has_host, dot_dtype=dot_dtype,
                        quantized=quantized),
      grid=(tokens, tiles),
      in_specs=[pl.BlockSpec((None, heads_pad, padded_dim), lambda t, j: (t, 0, 0)),
                pl.BlockSpec((None, heads_pad), lambda t, j: (t, 0)),
                pages_spec(index_pages), pages_spec(host_index),
                *(pages_spec(x, 1) for x in scales), ids_spec, ids_spec],
      out_specs=pl.BlockSpec((None, per_program * block_size), lambda t, j: (t, j)),
      out_shape=jax.ShapeDtypeStruct((tokens, tiles * per_program * block_size), jnp.float32),
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret),
      name="index_scores",
  )(q, w, index_pages, host_index, *scales, jnp.pad(tables.astype(jnp.int32), pad),
    jnp.pad(host_tables.astype(jnp.int32), pad))
  return out[:, :width * block_size]


def _gather_keys(pages, tables) -> jax.Array:
  """float32 [tokens, width, block_size, 1, dim]: `pages[tables]`; 8-bit pages as values *
  scales in float32 (the exact dequantized keys, not rounded to the pages' dtype)."""
  if isinstance(pages, QuantizedPages):
    return quant.dequantize(pages.values[tables], pages.scales[tables], jnp.float32)
  return _bits(pages)[tables].astype(jnp.float32)


def index_scores_reference(index_q, index_w, index_pages, tables, host_index=None,
                           host_tables=None) -> jax.Array:
  """What `index_scores` computes, over gathered keys in float32 (transformers' order:
  relu(q . k * dim**-0.5), then the weighted sum over heads; 8-bit keys dequantized)."""
  _check(index_q, index_w, index_pages, tables, host_index, host_tables)
  tokens, _, dim = index_q.shape
  keys = _gather_keys(index_pages, tables)  # [tokens, width, block_size, 1, dim]
  if host_index is not None:
    keys = jnp.where((tables != 0)[..., None, None, None], keys,
                     _gather_keys(host_index, host_tables))
  keys = keys.reshape(tokens, -1, dim)
  s = jnp.einsum("thd,tkd->thk", index_q.astype(jnp.float32), keys)
  s = jax.nn.relu(s * dim**-0.5)
  return jnp.einsum("th,thk->tk", index_w.astype(jnp.float32), s)
