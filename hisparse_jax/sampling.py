"""Sampling parameters (validated, host side) and the batched JAX sampler.

`SamplingParams` mirrors vLLM's names. `sample` takes one row of parameters per
sequence so a continuous batch can mix greedy and stochastic requests in one
jitted call: greedy where temperature == 0, otherwise temperature -> top-k ->
top-p filtering, then a categorical draw from a per-request key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """What to sample and when to stop; validated on construction."""

  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0  # 0 (or -1) disables top-k.
  max_tokens: int = 16
  seed: int | None = None
  stop_token_ids: Sequence[int] = ()
  ignore_eos: bool = False
  # Strings that end the output when its text contains one (matched across token
  # boundaries); the text stops before it unless include_stop_str_in_output (vLLM's).
  stop: str | Sequence[str] = ()
  include_stop_str_in_output: bool = False

  def __post_init__(self):
    if not np.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < -1:
      raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
    for s in stop:
      if not isinstance(s, str) or not s:
        raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    object.__setattr__(self, "stop", stop)

  @property
  def stop_hold_back(self) -> int:
    """Characters of the text held back while the request runs: the longest a stop
    string could have started without being complete (none when stop strings are kept
    in the output, which then ends after them)."""
    if not self.stop or self.include_stop_str_in_output:
      return 0
    return max(len(s) for s in self.stop) - 1

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def request_key(seed: int, num_generated: int) -> jax.Array:
  """The key for a request's `num_generated`-th draw: reproducible across batches."""
  return jax.random.fold_in(jax.random.key(seed), num_generated)


@jax.jit
def greedy(logits: jax.Array) -> jax.Array:
  """int32 [batch]: the first index of each row's largest logit (jnp.argmax's answer),
  as a max and a min over indices: two vectorized reductions, where XLA:CPU's argmax is
  one scalar (value, index) reduction (measured 74 us for [32, 1031])."""
  logits = jnp.where(jnp.isnan(logits), jnp.inf, logits)  # argmax picks a NaN first
  vocab = logits.shape[-1]
  best = logits.max(axis=-1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(logits == best, index, vocab), axis=-1)


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
           keys: jax.Array) -> jax.Array:
  """Samples one token per row.

  Args:
    logits: float [batch, vocab].
    temperature: float32 [batch]; 0 means greedy for that row.
    top_p: float32 [batch] in (0, 1].
    top_k: int32 [batch]; <= 0 disables top-k for that row.
    keys: typed PRNG keys [batch].
  Returns:
    int32 [batch] token ids.
  """
  chex.assert_rank(logits, 2)
  batch, vocab = logits.shape
  chex.assert_shape([temperature, top_p, top_k], (batch,))
  logits = logits.astype(jnp.float32)
  greedy_ids = greedy(logits)

  safe_t = jnp.where(temperature > 0, temperature, 1.0)
  scaled = logits / safe_t[:, None]
  sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
  # top-k: keep logits >= the k-th largest.
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
  # top-p: keep the smallest prefix of the (top-k filtered) sorted distribution
  # whose mass reaches top_p; the first token is always kept.
  ranks = jnp.arange(vocab)[None, :]
  sorted_masked = jnp.where(ranks < k[:, None], sorted_logits, -jnp.inf)
  probs = jax.nn.softmax(sorted_masked, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = (mass_before < top_p[:, None]) & (ranks < k[:, None])
  num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
  pth = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
  threshold = jnp.maximum(kth, pth)
  filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
  drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy_ids)
