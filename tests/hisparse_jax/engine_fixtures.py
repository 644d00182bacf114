"""Shared set-up of the engine tests: one tiny random Llama, engines of one geometry, and a
full-recompute dense reference.

Every engine test uses the same geometry (block_size 8, max_model_len 64, 4 sequences, a
64-token step budget, a 12-block device pool) unless it needs otherwise: the jitted step is
shared by all engines over the same model structure, so equal pool shapes and buckets reuse
the compiled programs and the whole file compiles a handful of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.request import RequestOutput
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from models.config import ModelConfig
from models.llama import LlamaForCausalLM

GIB = 2**30
VOCAB = 97
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
NUM_DEVICE_BLOCKS = 13  # null block + 12 usable = 96 tokens: 1.5 requests of max_model_len
NUM_HOST_BLOCKS = 33


def tiny_config(**overrides) -> ModelConfig:
  fields = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=256, eos_token_id=None)
  return ModelConfig(**{**fields, **overrides})


@functools.cache
def tiny_model(seed: int = 0) -> LlamaForCausalLM:
  return LlamaForCausalLM(tiny_config(), seed=seed)


def gib_for_blocks(model_config: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE,
                   dtype: str = "float32") -> float:
  """A GiB budget that plans exactly `num_blocks` blocks (null block included)."""
  spec = KVCacheSpec.from_model_config(model_config, dtype, block_size)
  return (num_blocks + 0.5) * spec.bytes_per_block / GIB


def make_engine(model=None, model_config=None, *, num_device_blocks: int = NUM_DEVICE_BLOCKS,
                num_host_blocks: int = NUM_HOST_BLOCKS, tokenizer=None, **overrides) -> Engine:
  model = model if model is not None else tiny_model()
  model_config = model_config if model_config is not None else model.config
  geometry = (overrides.get("block_size", BLOCK_SIZE), overrides.get("dtype", "float32"))
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=64,
                device_kv_gib=gib_for_blocks(model_config, num_device_blocks, *geometry),
                host_pool_gib=gib_for_blocks(model_config, num_host_blocks, *geometry))
  engine = Engine(EngineConfig(**{**fields, **overrides}), model=model,
                  model_config=model_config, tokenizer=tokenizer)
  assert engine.device_pool.num_blocks == num_device_blocks
  assert engine.host_pool.num_blocks == num_host_blocks
  return engine


def run(engine: Engine, *, max_steps: int = 2000) -> dict[str, RequestOutput]:
  """Steps until no request is left; checks invariants after every step and that every
  request finishes exactly once. Returns the final output of each request by id."""
  finished: dict[str, RequestOutput] = {}
  for _ in range(max_steps):
    if not engine.has_unfinished_requests():
      break
    for out in engine.step():
      if out.finished:
        assert out.request_id not in finished, f"{out.request_id} finished twice"
        finished[out.request_id] = out
      else:
        assert out.request_id not in finished, f"{out.request_id} advanced after finishing"
    engine.check_invariants()
  else:
    raise AssertionError(f"requests left after {max_steps} steps")
  return finished


def add_all(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams,
            prefix: str = "r") -> list[str]:
  return [engine.add_request(f"{prefix}{i}", prompt_token_ids=p, sampling_params=params)
          for i, p in enumerate(prompts)]


def run_alone(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams,
              ) -> list[list[int]]:
  """Each prompt's tokens with the prompt alone in `engine`, one request after another: a
  pool that holds one request's blocks never preempts, swaps or offloads it, so this is
  the all-resident run of the engine's own compiled programs (an engine with a bigger pool
  compiles its own). Salted (cache_salt) apart from later unsalted requests, which then
  share no prefix-cache block with these."""
  tokens = []
  for i, p in enumerate(prompts):
    rid = engine.add_request(f"alone{i}", prompt_token_ids=p, sampling_params=params,
                             cache_salt="alone")
    tokens.append(list(run(engine)[rid].outputs[0].token_ids))
  return tokens


def assert_all_blocks_free(engine: Engine) -> None:
  """After every request finished: no block is owned in either tier (only free or cached)."""
  engine.check_invariants()
  for pool in engine.block_manager.pools.values():
    assert pool.num_used_blocks == 0, (pool.memory_kind, pool.num_used_blocks)
    assert pool.num_free_blocks == pool.num_usable_blocks, pool.memory_kind
  assert engine.block_manager.seq_ids == []
  assert engine.metrics()['hisparse_kv_usage_ratio{memory_kind="device"}'] == 0.0


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
  from flax import nnx
  model = nnx.merge(graphdef, state)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return model(ids, positions)[0]  # [batch, seq, vocab], dense causal attention, no cache


def reference_greedy(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]],
                     num_tokens: int) -> list[list[int]]:
  """Greedy tokens by full recompute: the model runs over the whole sequence every step.

  All prompts share one [batch, max_prompt + num_tokens] buffer (causal attention, so a
  row's unfilled tail does not change its logits): one compile for all steps.
  """
  from flax import nnx
  graphdef, state = nnx.split(model)
  lens = np.array([len(p) for p in prompts])
  buf = np.zeros((len(prompts), int(lens.max()) + num_tokens), np.int32)
  for row, p in enumerate(prompts):
    buf[row, :len(p)] = p
  rows = np.arange(len(prompts))
  for i in range(num_tokens):
    logits = np.asarray(_forward(graphdef, state, jnp.asarray(buf)))
    buf[rows, lens + i] = logits[rows, lens + i - 1].argmax(-1)
  return [buf[row, lens[row]:lens[row] + num_tokens].tolist() for row in rows]


def dense_last_logits(model: LlamaForCausalLM, ids: Sequence[int], width: int = 64
                      ) -> np.ndarray:
  """float32 [vocab] (a writable copy): the logits after `ids` by the dense forward over
  the whole sequence (no KV cache), in a buffer of `width` tokens so every length runs
  one compiled program (causal: the unfilled tail does not change them)."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  buf = np.zeros((1, width), np.int32)
  buf[0, :len(ids)] = ids
  return np.array(_forward(graphdef, state, jnp.asarray(buf))[0, len(ids) - 1], np.float32)


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


# The six prompts the engine tests share: on the small device pool they are swapped out
# and back (and, with HiSparse, offloaded), from 3 to 40 tokens.
SIX_PROMPTS = random_prompts((5, 17, 40, 33, 9, 3), seed=0)
