"""The model runner of DSA models (DeepSeek-V3.2, GLM-MoE-DSA: models/deepseek_v32.py).

The same runner as llama models' (`ModelRunner`: one jitted step, pools donated, the
hot-buffer state between steps) over a DSA model's caches (kv_cache.kv_pool.MLACacheSpec:
per layer a latent array and, in layers with an indexer, an indexer-key array) and its
attention (sparse.dsa_attention). What differs:

- the step program is `step_program.dsa_step_program` (the learned indexer picks tokens
  per query; no key bounds, no packed CPU weights);
- with HiSparse (`indexer="lightning"`), `bounds` holds, for each layer with an indexer,
  the indexer keys of every HOST block on the device ([num_host_blocks, block_size, 1,
  index_dim]): written when a block is copied to the host pool (swap-out or
  write-through, `copy_bounds_to_host_index`), read by the indexer for the blocks an
  offloaded sequence dropped; the device blocks' keys are the pool's own `index_k`;
- the hot buffer is token-granular: hot_buffer_blocks x block_size token slots per
  offloaded sequence, and the evicted-at row of the hot-buffer state is per token;
- a step's host loads move tokens (one latent entry each), not blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

import kernels_pallas
from hisparse_jax.engine.runner import ModelRunner
from hisparse_jax.engine.step_program import dsa_step_program
from hisparse_jax.kv_cache.kv_pool import device_full_fn
from hisparse_jax.kv_cache.transfer import bucket_size, host_copy_mode
from hisparse_jax.sparse.dsa_attention import DsaStatic


class DsaModelRunner(ModelRunner):
  """`ModelRunner` of a DSA model (see the module docstring). Invariant besides
  ModelRunner's: with HiSparse, row h of `bounds[j]` holds the indexer keys of host
  block h of the j-th layer with an indexer whenever host block h holds a copy."""

  packs_weights = False

  def __init__(self, *args, record_topk: bool = False, **kwargs):
    """record_topk: every step also returns each layer's selected key positions per token
    (StepResult.topk; tests compare them with transformers' indexer)."""
    self.record_topk = record_topk
    super().__init__(*args, **kwargs)

  def set_record_topk(self, record: bool) -> None:
    """Whether each later step also returns its selections (StepResult.topk)."""
    if self.compiler is not None:
      raise ValueError("record_topk: not with compile_in_background (its compiled "
                       "programs are the step's without the selections)")
    self.record_topk = record
    self._step = self._step_for(self.ops, one_memory=None)

  @property
  def spec(self):
    return self.pool.spec

  def _sparse_state(self):
    spec = self.spec
    host_index = host_index_arrays(
        spec, self.host_pool.num_blocks, self.pool.storage_dtype,
        lambda shape, dtype: device_full_fn(shape, dtype, 0, self.pool.sharding)())
    blocks = self.hisparse_blocks
    return host_index, self._hot_state(blocks.hot_buffer_blocks * spec.block_size,
                                       self.max_blocks_per_seq * spec.block_size)

  def _builder_options(self) -> dict:
    return dict(index_topk=self.config.index_topk)

  def _step_for(self, ops: kernels_pallas.KernelOps, one_memory: bool | None):
    config, hisparse = self.config, self.hisparse
    static = DsaStatic(index_topk=config.index_topk, kv_lora_rank=config.kv_lora_rank,
                       softmax_scale=config.softmax_scale, record_topk=self.record_topk)
    if hisparse is not None:
      static = DsaStatic(
          index_topk=config.index_topk, kv_lora_rank=config.kv_lora_rank,
          softmax_scale=config.softmax_scale, record_topk=self.record_topk, tiered=True,
          hot_buffer_blocks=self.hisparse_blocks.hot_buffer_blocks,
          thrash_window_steps=hisparse.thrash_window_steps,
          device_sharding=self.pool.sharding, host_sharding=self.host_pool.sharding,
          one_memory=one_memory, host_copy=host_copy_mode())
    return dsa_step_program(self._graphdef, ops, self.spec.dtype, static,
                            self.spec.index_layers, params_def=self._params_def)

  @property
  def indexer_bytes(self) -> int:
    """Device bytes of the indexer keys of host blocks (HiSparse)."""
    return sum(int(b.nbytes) for b in jax.tree.leaves(self.bounds))

  @property
  def load_unit_bytes(self) -> int:
    """Bytes one in-step host load moves per layer: a token's latent entry."""
    return self.spec.latent_dim * self.spec.itemsize

  def copy_bounds_to_host_index(self, device_ids: np.ndarray, host_ids: np.ndarray) -> None:
    """The indexer keys of host blocks `host_ids` := those of device blocks
    `device_ids` (blocks just copied to the host pool), every layer with an indexer."""
    if not self.bounds or len(device_ids) == 0:
      return
    n = bucket_size(len(device_ids), 4)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.host_pool.num_blocks, np.int32)  # padding: out of range, dropped
    src[:len(device_ids)] = device_ids
    dst[:len(device_ids)] = np.asarray(host_ids)
    self.bounds = _copy_index_keys(self.pool.index_keys(), self.bounds, src, dst)

  def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: device block src -> dst of both caches, every layer."""
    if not copies:
      return
    n = bucket_size(len(copies), 4)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.pool.num_blocks, np.int32)  # padding: out of range, dropped
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    self.pool.set_arrays(self._copy(self.pool.arrays(), src, dst))

  def lowered_block_programs(self, buckets: Sequence[int]) -> list[jax.stages.Lowered]:
    """ModelRunner's, over this runner's programs: the copy-on-write copy of both caches
    (first bucket) and, with HiSparse, the indexer keys' copy to the host index (no
    refresh)."""
    out = []
    for i, n in enumerate(buckets):
      ids = np.zeros(n, np.int32)
      if i == 0:
        out.append(self._copy.lower(self.pool.arrays(), ids, ids))
      if self.bounds:
        out.append(_copy_index_keys.lower(self.pool.index_keys(), self.bounds, ids, ids))
    return out

  def refresh_bounds(self, device_ids: np.ndarray) -> None:
    """Nothing to do: a swapped-in block's indexer keys come in with its latent entries
    (both are pool arrays)."""
    del device_ids


def host_index_arrays(spec, num_host_blocks: int, storage_dtype, make) -> tuple:
  """The device copy of the host blocks' indexer keys (`DsaModelRunner.bounds`), one entry
  per layer with an indexer: make(shape, dtype) of [num_host_blocks, block_size, 1,
  index_head_dim] in the pool's storage dtype, or with 8-bit indexer keys a (values,
  float32 scales [..., 1]) pair (the pool's index_k / index_scale layout)."""
  shape = (num_host_blocks, spec.block_size, 1, spec.index_head_dim)
  if not spec.index_quantized:
    return tuple(make(shape, storage_dtype) for _ in spec.index_layers)
  return tuple((make(shape, spec.index_dtype), make((*shape[:3], 1), "float32"))
               for _ in spec.index_layers)


def _copy_index_keys_fn(device_keys, host_index, src, dst):
  # (each layer's keys: an array, or an 8-bit (values, scales) pair: the same copy of each)
  return jax.tree.map(lambda d, h: h.at[dst].set(d[src], mode="drop"), tuple(device_keys),
                      tuple(host_index))


_copy_index_keys = jax.jit(_copy_index_keys_fn, donate_argnums=(1,))
