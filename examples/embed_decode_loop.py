"""Embedding hisparse_jax in your own JAX serving stack: a hand-written decode loop, no Engine.

The loop below is yours (batching, when to preempt, when to stop); hisparse_jax gives it:

  hisparse_jax.kv_cache   plan_capacity -> the device and pinned_host pools, with the
                          capacity line of each memory kind (CapacityReport); a
                          BlockManager (block tables, prefix cache, swap plans); a
                          TransferEngine (the batched moves that carry the plans out)
  hisparse_jax.sparse     `attend`: one layer's attention in your jitted step (write the new
                          K/V into their slots, then paged attention over each sequence's
                          blocks; with a SparseStatic, HiSparse's select -> resolve -> load
                          -> attend), plugged into the model as its AttnFn
  kernels_pallas          the kernels `attend` calls (`kernels_pallas.ops()`: the C++ / jnp
                          path on CPU, Pallas on a GPU)

What it does: prefills every prompt in one ragged step, then decodes greedily one token
per sequence per step; halfway, the first sequence is preempted by swapping its blocks
out to the pinned_host pool and brought back one step later (its tokens do not change:
tests/test_embedding_example.py checks them against the Engine's).

    .venv/bin/python examples/embed_decode_loop.py            # the embedded tiny model
    .venv/bin/python examples/embed_decode_loop.py --model=DIR --max_new_tokens=32
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from hisparse_jax.kv_cache import (
  BlockManager,
  CapacityReport,
  KVCacheSpec,
  TransferEngine,
  plan_capacity,
)
from hisparse_jax.sparse import StepMetadata, attend
from models.loader import load_pretrained


def make_step(model: nnx.Module, pool_spec: KVCacheSpec, storage_dtype, ops):
  """The jitted step: tokens of several sequences (a flat ragged batch) -> each sequence's
  next token (greedy), the device pool's arrays donated and returned updated."""
  graphdef, params = nnx.split(model)
  num_layers = pool_spec.num_layers
  attn_fn = functools.partial(attend, ops, pool_spec.dtype, storage_dtype, None)

  @functools.partial(jax.jit, static_argnames=("hints",), donate_argnums=(1,))
  def step(params, kv_arrays, input_ids, positions, slot_ids, block_tables, kv_lens,
           cu_q_lens, last_rows, hints):
    model = nnx.merge(graphdef, params)
    metadata = StepMetadata(slot_ids=slot_ids, block_tables=block_tables, kv_lens=kv_lens,
                            cu_q_lens=cu_q_lens, sparse_rows=jnp.zeros_like(kv_lens, bool),
                            ragged_hints=hints)
    # Layer i's cache: (k pages, v pages) of the device pool, in the layout KVPool keeps.
    caches = [(kv_arrays[i], kv_arrays[num_layers + i]) for i in range(num_layers)]
    hidden, caches = model.hidden_states(input_ids[None], positions[None], attn_fn=attn_fn,
                                         kv_caches=caches, attn_metadata=metadata)
    logits = model.compute_logits(hidden[0, last_rows])
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, tuple(c[0] for c in caches) + tuple(c[1] for c in caches)

  return functools.partial(step, params)


def generate(prompts: list[list[int]], max_new_tokens: int, *, model_dir: str | None = None,
             block_size: int = 16, device_kv_gib: float = 0.01, host_pool_gib: float = 0.01,
             max_model_len: int = 2048, swap_at_step: int | None = None) -> dict:
  """Greedy completions of `prompts` (token ids); returns {"tokens": [[...]], "capacity":
  CapacityReport, "swapped_blocks": blocks moved each way by the preemption}."""
  model, config, _ = load_pretrained(model_dir)
  spec = KVCacheSpec.from_model_config(config, "float32", block_size)
  # 1. Pools by memory kind, sized from the budgets, and their capacity lines.
  plan = plan_capacity(spec, max_model_len=max_model_len, device_kv_gib=device_kv_gib,
                       host_pool_gib=host_pool_gib)
  device_pool, host_pool = plan.allocate()
  capacity = CapacityReport.from_pools((device_pool, host_pool))
  for line in capacity.log_lines(max_model_len):
    print(line)
  # 2. Block bookkeeping over both tiers, and the moves between them.
  blocks = BlockManager(device_pool.num_blocks, host_pool.num_blocks, block_size,
                        enable_prefix_caching=False)
  transfer = TransferEngine(device_pool, host_pool)
  ops = kernels_pallas.ops()
  step = make_step(model, spec, device_pool.storage_dtype, ops)

  def run(seq_ids, input_ids, positions, slot_ids, q_lens):
    """One step over the sequences `seq_ids` (their tokens flat, q_lens each)."""
    width = max(blocks.num_table_blocks(s) for s in seq_ids)
    tables = blocks.block_tables(seq_ids, width)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.array([blocks.num_tokens(s) for s in seq_ids], np.int32)
    hints = tuple(sorted(ops.ragged_hints(list(q_lens)).items()))
    tokens, arrays = step(device_pool.arrays(), np.asarray(input_ids, np.int32),
                          np.asarray(positions, np.int32), np.asarray(slot_ids, np.int32),
                          tables, kv_lens, cu_q_lens, cu_q_lens[1:] - 1, hints)
    device_pool.set_arrays(arrays)
    return np.asarray(tokens).tolist()

  # 3. Prefill: every prompt in one ragged step.
  outputs: dict[int, list[int]] = {}
  slots = [blocks.allocate(i, p).slot_ids for i, p in enumerate(prompts)]
  tokens = run(list(range(len(prompts))), np.concatenate(prompts),
               np.concatenate([np.arange(len(p)) for p in prompts]), np.concatenate(slots),
               [len(p) for p in prompts])
  for i, token in enumerate(tokens):
    outputs[i] = [token]
  # 4. Decode, one token per running sequence per step; one preemption by swap.
  swapped = {"out": 0, "in": 0}
  step_index = 0
  while any(len(out) < max_new_tokens for out in outputs.values()):
    if step_index == swap_at_step:  # preempt sequence 0: its blocks go to the host pool
      plan_out = blocks.swap_out(0)
      transfer.swap_out(plan_out.device_ids, plan_out.host_ids)
      blocks.finish_step()
      swapped["out"] = plan_out.num_blocks
    elif blocks.is_swapped(0):  # and back, one step later (its KV unchanged)
      plan_in = blocks.swap_in(0)
      transfer.swap_in(plan_in.host_ids, plan_in.device_ids)
      swapped["in"] = plan_in.num_blocks
    step_index += 1
    running = [i for i, out in outputs.items()
               if len(out) < max_new_tokens and not blocks.is_swapped(i)]
    last = [outputs[i][-1] for i in running]
    slot_ids = [blocks.append_slot(i, t).slot_id for i, t in zip(running, last)]
    positions = [blocks.num_tokens(i) - 1 for i in running]
    new = run(running, last, positions, slot_ids, [1] * len(running))
    blocks.finish_step()  # releases the host blocks a swap-in pinned
    for i, token in zip(running, new):
      outputs[i].append(token)
  for i in list(outputs):
    blocks.free(i)
  blocks.check_invariants()
  return {"tokens": [outputs[i] for i in range(len(prompts))],
          "capacity": capacity, "swapped_blocks": swapped}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default=None, help="HF checkpoint directory (default: the "
                      "embedded hisparse-tiny)")
  parser.add_argument("--max_new_tokens", type=int, default=16)
  parser.add_argument("--block_size", type=int, default=16)
  args = parser.parse_args()
  from models import data  # noqa: PLC0415
  from models.loader import load_tokenizer  # noqa: PLC0415

  tokenizer = load_tokenizer(args.model)
  texts = [data.EXAMPLE_PROMPT, "bafu: bapo\nbaki: bare\n? baki:"]
  prompts = [tokenizer.encode(t) for t in texts]
  result = generate(prompts, args.max_new_tokens, model_dir=args.model,
                    block_size=args.block_size, swap_at_step=args.max_new_tokens // 2)
  for text, tokens in zip(texts, result["tokens"]):
    print(repr(text[-40:]), "->", repr(tokenizer.decode(tokens)))
  print("preemption by swap: blocks out / in:", result["swapped_blocks"])


if __name__ == "__main__":
  main()
