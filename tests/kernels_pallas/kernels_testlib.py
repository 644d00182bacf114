"""Builders and independent numpy attention for the kernel tests, and the deviceless
H200 lowering they share (`lower_for_h200`).

The naive attention uses nothing of kernels_pallas: plain numpy softmax over explicitly
gathered tokens, so it checks the references as well as the kernels.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Pairwise covering array over the grid: every pair of values of any two of
# (GQA ratio, block_size, head_dim, dtype) appears in some row (checked in a test).
GRID_VALUES = ((1, 4, 8), (8, 16, 32), (64, 128), ("float32", "bfloat16"))
PAIRWISE_GRID = (
    (1, 8, 64, "float32"),
    (1, 16, 128, "bfloat16"),
    (1, 32, 64, "bfloat16"),
    (4, 8, 128, "bfloat16"),
    (4, 16, 64, "float32"),
    (4, 32, 128, "float32"),
    (8, 8, 64, "bfloat16"),
    (8, 16, 128, "float32"),
    (8, 32, 64, "float32"),
)


def missing_pairs(rows, values=GRID_VALUES) -> set:
  missing = set()
  for a, b in itertools.combinations(range(len(values)), 2):
    have = {(r[a], r[b]) for r in rows}
    missing |= {(a, b, x, y) for x, y in itertools.product(values[a], values[b])
                if (x, y) not in have}
  return missing


def grid_lengths(block_size: int) -> list[int]:
  """The issue's lengths: 1, bs-1, bs, bs+1 and long (plus 0)."""
  return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 0]


class Pool(NamedTuple):
  k_pages: jnp.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
  v_pages: jnp.ndarray
  k_np: np.ndarray  # float32 copies (values exactly as stored in the pages' dtype)
  v_np: np.ndarray


def make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, dtype) -> Pool:
  shape = (num_blocks, block_size, num_kv_heads, head_dim)
  k = jnp.asarray(rng.standard_normal(shape), dtype)
  v = jnp.asarray(rng.standard_normal(shape), dtype)
  return Pool(k, v, np.array(k.astype(jnp.float32)), np.array(v.astype(jnp.float32)))


def make_tables(rng, lengths, block_size, max_blocks, num_blocks) -> np.ndarray:
  """Permuted, non-monotonic tables of distinct non-null blocks, 0-padded past the length."""
  tables = np.zeros((len(lengths), max_blocks), np.int32)
  for b, n in enumerate(lengths):
    used = -(-n // block_size)
    tables[b, :used] = rng.choice(np.arange(1, num_blocks), size=used, replace=False)
  return tables


def gather_tokens(pages: np.ndarray, table, length: int) -> np.ndarray:
  """[length, num_kv_heads, head_dim]: the first `length` tokens through `table`."""
  return pages[np.asarray(table)].reshape(-1, *pages.shape[2:])[:length]


def naive_attention(q, k, v, *, sm_scale=None, soft_cap=None, mask=None) -> np.ndarray:
  """Plain softmax attention in float64. q [n, Hq, d], k/v [t, Hkv, d], mask [n, t]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  n, num_q_heads, d = q.shape
  group = num_q_heads // k.shape[1]
  out = np.zeros((n, num_q_heads, d))
  scale = d**-0.5 if sm_scale is None else sm_scale
  for h in range(num_q_heads):
    s = q[:, h] @ k[:, h // group].T * scale  # [n, t]
    if soft_cap is not None:
      s = soft_cap * np.tanh(s / soft_cap)
    m = np.ones_like(s, bool) if mask is None else mask
    for i in range(n):
      if not m[i].any():
        continue
      e = np.exp(s[i, m[i]] - s[i, m[i]].max())
      out[i, h] = (e / e.sum()) @ v[m[i], h // group]
  return out


def causal_mask(q_len: int, kv_len: int, sliding_window=None) -> np.ndarray:
  pos = kv_len - q_len + np.arange(q_len)[:, None]
  key = np.arange(kv_len)[None, :]
  mask = key <= pos
  if sliding_window is not None:
    mask &= key > pos - sliding_window
  return mask


def max_abs_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0))


def lower_for_h200(fn, *args):
  """(the H200 target, fn jitted, traced over `args` and lowered for "cuda" inside the
  target's kernel context): `target.compile(lowered)` then runs XLA's GPU compiler on it
  with no GPU (hisparse_jax.engine.gpu_target)."""
  import jax  # noqa: PLC0415

  from hisparse_jax.engine.gpu_target import load_target  # noqa: PLC0415

  target = load_target("h200")
  with target.kernel_context():
    return target, jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
