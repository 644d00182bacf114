"""Retrieval accuracy of the default model: dense vs "shared" vs "per_kv_head" selection.

Owns the measurement behind the selection-mode choice (issue #7), outside the engine: a
pure-JAX decode over `models/llama.py` whose `AttnFn` keeps one contiguous KV cache per
layer. Per context length, fresh retrieval prompts (`models.data.make_retrieval_prompts`,
a seed the trainer does not use) are decoded greedily, once densely and once per
(selection, top_k_tokens) pair; an answer is right when the first word of the output is
the expected word (as `hisparse_jax.bench.sparse_accuracy`).

What one sparse decode step does (every layer, every row):

  key bounds of each cache block over its valid keys (min/max per KV head, post-RoPE,
  what kernels_pallas.block_key_bounds keeps) -> hisparse_jax.sparse.indexer.select (sink and
  local blocks forced, the rest by score, `top_k_blocks` in all) -> attention over the
  keys of the selected blocks only; "per_kv_head": the query heads of a KV group see
  only that KV head's blocks.

Why the prompt's LAST token is decoded as a sparse step: the dense prefill covers the
prompt minus its last token (the queried key), so the query that retrieves the answer
attends through the selection. (Prefilling the whole prompt densely would produce the
answer token from dense attention, and every mode would agree on it by construction.)
So `max_new_tokens` sparse steps run per prompt: the query key, then the generated
tokens but the last.

Reported per mode: accuracy; how often the first generated token equals dense's; the
fraction of valid blocks attended (mean over steps, layers, KV heads: the attention
cost) and touched by any KV head (what must be resident or loaded from the host: a block
holds every head, so "per_kv_head" moves the union of its heads' blocks); and, per layer,
the share of the dense attention that the selected keys hold at the query step (mean
over prompts and query heads): the selection's recall where it matters, finer than
accuracy. (Not "is the answer token selected": a model's circuit need not read the
answer's own position; hisparse-tiny's, looked at once, reads a position ~28 tokens
after it, where its first layer copies the line to by fixed offsets.)

  python -m hisparse_jax.bench.selection_accuracy [--num_prompts=100] \\
      [--context_lens=512,1024] [--top_k_tokens=256,512] [--out=results/...json]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from hisparse_jax.bench import common
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseBlocks, HiSparseConfig
from kernels_pallas.block_key_bounds import quantize_bounds, round_bounds
from models.attention import dense_causal_attention
from models.llama import LlamaForCausalLM

_MASKED = -1e30
# The selections this decode measures: a mask per KV head ("per_query_head" would need one
# per query head; the passkey suite measures it through the engine).
SELECTIONS = ("union", "shared", "per_kv_head")
MAX_NEW_TOKENS = 2  # the answer word and what follows it (as sparse_accuracy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """One layer's contiguous KV cache and what its last decode step attended.

  Invariant: `capacity` (axis 1) is a multiple of the block size, so block b holds keys
  [b * block_size, (b + 1) * block_size); rows of one batch share their length.
  """

  k: jax.Array  # [batch, capacity, num_kv_heads, head_dim]
  v: jax.Array  # [batch, capacity, num_kv_heads, head_dim]
  attended: jax.Array  # float32 [batch]: fraction of valid blocks attended (mean over KV heads)
  touched: jax.Array  # float32 [batch]: fraction of valid blocks ANY KV head attended
  mass: jax.Array  # float32 [batch]: share of dense attention the last step's keys hold


def block_bounds(k: jax.Array, kv_lens: jax.Array, block_size: int,
                 bounds_dtype: str = "float32") -> jax.Array:
  """[batch, num_blocks, 2, num_kv_heads, head_dim] min (0) / max (1) of each block's
  valid keys (position < kv_lens); blocks without a valid key get 0 (the indexer masks
  them as invalid anyway). k: [batch, capacity, num_kv_heads, head_dim]. `bounds_dtype`:
  what the engine stores (HiSparseConfig.bounds_dtype), rounded outward as
  kernels_pallas.block_key_bounds does (int8: the QuantizedBounds' values x scales, in
  float32: what the engine's scores read)."""
  batch, capacity, num_kv_heads, head_dim = k.shape
  blocks = k.reshape(batch, capacity // block_size, block_size, num_kv_heads, head_dim)
  pos = jnp.arange(capacity).reshape(1, -1, block_size, 1, 1)
  valid = pos < kv_lens.reshape(-1, 1, 1, 1, 1)
  k_min = jnp.where(valid, blocks, jnp.inf).min(axis=2)
  k_max = jnp.where(valid, blocks, -jnp.inf).max(axis=2)
  any_valid = valid.any(axis=2)
  if bounds_dtype == "int8":
    k_min, k_max = (jnp.where(any_valid, x, 0) for x in (k_min, k_max))
    bounds = quantize_bounds(k_min, k_max).dequantize()
  else:
    bounds = jnp.stack(round_bounds(k_min, k_max, bounds_dtype), axis=2)
  return jnp.where(any_valid[:, :, None], bounds, 0).astype(bounds.dtype)


def selection_mask(q: jax.Array, k: jax.Array, kv_lens: jax.Array,
                   blocks: HiSparseBlocks | None, selection: str = "shared",
                   bounds_dtype: str = "float32") -> jax.Array:
  """bool [batch, num_kv_heads, capacity]: which cached keys each KV head's queries may
  attend (for "shared" the same row for every KV head).

  q: [batch, num_q_heads, head_dim] (one decode query per row); k: [batch, capacity,
  num_kv_heads, head_dim]; kv_lens int32 [batch] (the query's own key included).
  `blocks` None is dense: every valid key.
  """
  batch, capacity, num_kv_heads, _ = k.shape
  valid_keys = jnp.arange(capacity)[None, :] < kv_lens[:, None]  # [batch, capacity]
  if blocks is None:
    return jnp.broadcast_to(valid_keys[:, None, :], (batch, num_kv_heads, capacity))
  if selection not in SELECTIONS:
    raise ValueError(f"selection_accuracy measures selections {SELECTIONS}, not {selection!r}")
  block_size = blocks.block_size
  num_blocks = capacity // block_size
  sel = indexer.select(q, block_bounds(k, kv_lens, block_size, bounds_dtype), kv_lens, blocks,
                       selection)
  ids = jnp.where(sel.valid, sel.logical_ids, num_blocks)  # padding matches no block
  chosen = (ids[..., None] == jnp.arange(num_blocks)).any(axis=-2)  # [b, (h,) num_blocks]
  if chosen.ndim == 2:  # one selection for every head ("union", "shared")
    chosen = jnp.broadcast_to(chosen[:, None, :], (batch, num_kv_heads, num_blocks))
  return jnp.repeat(chosen, block_size, axis=-1) & valid_keys[:, None, :]


def block_fractions(mask: jax.Array, kv_lens: jax.Array, block_size: int
                    ) -> tuple[jax.Array, jax.Array]:
  """float32 [batch] twice, shares of the valid blocks: attended (mean over KV heads,
  the attention cost) and touched by any KV head (what must be resident: a block holds
  every head's keys, so per-KV-head selections load their union). mask as
  `selection_mask` returns it."""
  batch, num_kv_heads, capacity = mask.shape
  chosen = mask.reshape(batch, num_kv_heads, capacity // block_size, block_size).any(axis=-1)
  n_valid = indexer.num_valid_blocks(kv_lens, block_size)
  attended = chosen.sum(axis=-1).mean(axis=-1) / n_valid
  touched = chosen.any(axis=1).sum(axis=-1) / n_valid
  return attended.astype(jnp.float32), touched.astype(jnp.float32)


def masked_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                            valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of one query per row over the keys `mask` keeps, and the share of
  the dense attention (over the `valid` keys) that those keys hold.

  q: [batch, num_q_heads, head_dim]; k, v: [batch, capacity, num_kv_heads, head_dim];
  mask bool [batch, num_kv_heads, capacity], within valid bool [batch, capacity].
  Returns [batch, num_q_heads, head_dim] and float32 [batch] (mean over query heads;
  1 when the mask keeps every valid key): a model-agnostic recall of the selection,
  finer than accuracy and independent of which token the model's circuit reads."""
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
  scores = jnp.einsum("bhgd,bkhd->bhgk", qg, k, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(head_dim))
  weights = jax.nn.softmax(scores + jnp.where(mask, 0.0, _MASKED)[:, :, None], axis=-1)
  out = jnp.einsum("bhgk,bkhd->bhgd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  dense = jax.nn.softmax(scores + jnp.where(valid, 0.0, _MASKED)[:, None, None], axis=-1)
  mass = jnp.where(mask[:, :, None], dense, 0.0).sum(axis=-1).mean(axis=(1, 2))
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype), mass


def _check_config(config: Any) -> None:
  if config.sliding_window is not None:
    raise ValueError("selection_accuracy models full causal attention; the model has "
                     f"sliding_window={config.sliding_window}")


def _prefill_attn(q, k, v, *, layer_idx, kv_cache, metadata, config):
  """AttnFn of the prefill: dense causal attention, keys and values stored from slot 0.
  `metadata` is (positions [batch, seq], capacity)."""
  del layer_idx, kv_cache
  _check_config(config)
  positions, capacity = metadata
  out = dense_causal_attention(q, k, v, q_positions=positions, k_positions=positions)
  pad = ((0, 0), (0, capacity - k.shape[1]), (0, 0), (0, 0))
  ones = jnp.ones((k.shape[0],), jnp.float32)
  cache = LayerCache(jnp.pad(k, pad), jnp.pad(v, pad), ones, ones, ones)
  return out, cache


def _decode_attn(q, k, v, *, layer_idx, kv_cache: LayerCache, metadata, config,
                 blocks: HiSparseBlocks | None, selection: str, block_size: int,
                 bounds_dtype: str = "float32"):
  """AttnFn of one decode step at position `metadata` (int32 scalar, every row): stores
  the new key/value, then attends over the selected keys."""
  del layer_idx
  _check_config(config)
  pos = metadata
  k_cache = jax.lax.dynamic_update_slice_in_dim(kv_cache.k, k.astype(kv_cache.k.dtype), pos, 1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(kv_cache.v, v.astype(kv_cache.v.dtype), pos, 1)
  kv_lens = jnp.full((q.shape[0],), pos + 1, jnp.int32)
  mask = selection_mask(q[:, 0], k_cache, kv_lens, blocks, selection, bounds_dtype)
  valid = jnp.arange(k_cache.shape[1])[None, :] < kv_lens[:, None]
  out, mass = masked_decode_attention(q[:, 0], k_cache, v_cache, mask, valid)
  attended, touched = block_fractions(mask, kv_lens, block_size)
  return out[:, None], LayerCache(k_cache, v_cache, attended, touched, mass)


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def prefill(graphdef, state, ids: jax.Array, *, capacity: int) -> list[LayerCache]:
  """Dense causal prefill of ids [batch, seq] at positions 0..seq-1 into caches of
  `capacity` slots (one LayerCache per layer)."""
  model = nnx.merge(graphdef, state)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  _, caches = model.hidden_states(ids, positions, attn_fn=_prefill_attn,
                                  attn_metadata=(positions, capacity))
  return caches


@functools.partial(jax.jit, static_argnames=("graphdef", "blocks", "selection", "block_size",
                                             "bounds_dtype"))
def decode_step(graphdef, state, caches: list[LayerCache], tokens: jax.Array, pos: jax.Array,
                *, blocks: HiSparseBlocks | None, selection: str, block_size: int,
                bounds_dtype: str = "float32") -> tuple[jax.Array, list[LayerCache]]:
  """Greedy next tokens int32 [batch] after tokens [batch] at position `pos`, and the
  updated caches (with the step's block fractions and attention mass per layer)."""
  model = nnx.merge(graphdef, state)
  attn = functools.partial(_decode_attn, blocks=blocks, selection=selection,
                           block_size=block_size, bounds_dtype=bounds_dtype)
  positions = jnp.full((tokens.shape[0], 1), pos, jnp.int32)
  hidden, caches = model.hidden_states(tokens[:, None], positions, attn_fn=attn,
                                       kv_caches=caches, attn_metadata=pos)
  return jnp.argmax(model.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32), caches


@dataclasses.dataclass(frozen=True)
class ModeOutput:
  """What `generate` returns for one mode."""

  tokens: np.ndarray  # int32 [batch, max_new_tokens]
  attended: np.ndarray  # float [batch]: attended block fraction, mean over steps and layers
  touched: np.ndarray  # float [batch]: fraction of blocks any KV head attended, same means
  query_mass: np.ndarray  # float [num_layers, batch]: share of the dense attention the first
  #                          sparse step (the prompt's last token) kept, per layer


@dataclasses.dataclass(frozen=True)
class Mode:
  """One decoding configuration: dense (`blocks` None) or a selection at a budget."""

  name: str
  blocks: HiSparseBlocks | None
  selection: str = "shared"
  bounds_dtype: str = "float32"  # of the key bounds (HiSparseConfig.bounds_dtype)


def generate(model: LlamaForCausalLM, prompt_ids: np.ndarray, modes: Sequence[Mode],
             block_size: int, max_new_tokens: int = MAX_NEW_TOKENS
             ) -> tuple[dict[str, ModeOutput], float]:
  """Greedy tokens of equal-length prompts [batch, seq] under every mode.

  The prompt but its last token is prefilled once (dense, shared by all modes); each
  mode then decodes `max_new_tokens` steps from it, the first over the prompt's last
  token. Returns {mode name: ModeOutput} and the prefill seconds.
  """
  if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 2:
    raise ValueError(f"prompt_ids must be [batch, seq >= 2], got {prompt_ids.shape}")
  for m in modes:
    if m.blocks is not None and m.blocks.block_size != block_size:
      raise ValueError(f"mode {m.name} has block_size {m.blocks.block_size}, not {block_size}")
  graphdef, state = nnx.split(model)
  seq = prompt_ids.shape[1]
  capacity = -(-(seq + max_new_tokens - 1) // block_size) * block_size
  ids = jnp.asarray(prompt_ids, jnp.int32)
  start = time.perf_counter()
  caches = jax.block_until_ready(prefill(graphdef, state, ids[:, :-1], capacity=capacity))
  prefill_s = time.perf_counter() - start
  out = {}
  for m in modes:
    tokens, mode_caches, steps, fractions, query_mass = ids[:, -1], caches, [], [], None
    for i in range(max_new_tokens):
      tokens, mode_caches = decode_step(graphdef, state, mode_caches, tokens,
                                        jnp.int32(seq - 1 + i), blocks=m.blocks,
                                        selection=m.selection, block_size=block_size,
                                        bounds_dtype=m.bounds_dtype)
      steps.append(tokens)
      fractions.append([[c.attended, c.touched] for c in mode_caches])
      if i == 0:
        query_mass = np.stack([np.asarray(c.mass) for c in mode_caches])
    attended, touched = np.asarray(fractions).mean(axis=(0, 1))  # [steps, layers, 2, batch]
    out[m.name] = ModeOutput(np.asarray(jnp.stack(steps, axis=1)), attended, touched,
                             query_mass)
  return out, prefill_s


def checkpoint_info(path: str) -> dict:
  """Which checkpoint was measured (the default model is retrained now and then): the
  weights' sha256 prefix and mtime, and the summary fields its training_info.json has."""
  weights = os.path.join(path, "model.safetensors")
  with open(weights, "rb") as f:
    info = {"path": path, "model_sha256_12": hashlib.sha256(f.read()).hexdigest()[:12]}
  info["model_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(os.path.getmtime(weights)))
  try:
    with open(os.path.join(path, "training_info.json")) as f:
      training = json.load(f)
  except (OSError, ValueError):
    training = {}
  info["training"] = {k: training[k] for k in ("recipe", "eval", "num_params", "completed_phase",
                                               "stopped_early", "elapsed_s") if k in training}
  return info


def make_modes(top_k_tokens: Sequence[int], sink_tokens: int, local_tokens: int,
               block_size: int, selections: Sequence[str] = SELECTIONS,
               bounds_dtypes: Sequence[str] = ("float32",)) -> list[Mode]:
  """Dense, then every (selection, budget, bounds dtype); budgets validated by
  HiSparseConfig. A bounds dtype other than float32 is named in the mode."""
  modes = [Mode("dense", None)]
  for selection in selections:
    for k in top_k_tokens:
      for bounds_dtype in bounds_dtypes:
        blocks = HiSparseConfig(top_k_tokens=k, sink_tokens=sink_tokens,
                                local_tokens=local_tokens, selection=selection,
                                bounds_dtype=bounds_dtype).blocks(block_size)
        suffix = "" if bounds_dtype == "float32" else f"/{bounds_dtype}"
        modes.append(Mode(f"{selection}@{k}{suffix}", blocks, selection, bounds_dtype))
  return modes


def evaluate(model: LlamaForCausalLM, tokenizer, context_len: int, num_prompts: int,
             seed: int, modes: Sequence[Mode], block_size: int, batch_size: int) -> dict:
  """One length's result: per mode, accuracy, agreement with dense, block fractions and
  attention mass (module docstring); `modes[0]` must be dense (the agreement's reference)."""
  if modes[0].blocks is not None:
    raise ValueError(f"modes[0] must be dense, got {modes[0].name}")
  from models import data  # noqa: PLC0415

  prompts = data.make_retrieval_prompts(num_prompts, context_len, seed=seed)
  ids = np.asarray([p.token_ids for p in prompts], np.int32)  # one length: same num_pairs
  if any(tokenizer.encode(p.text) != list(p.token_ids) for p in prompts):
    raise ValueError("the checkpoint's tokenizer does not match models.data's vocabulary")
  if ids.shape[1] > model.config.max_position_embeddings:
    raise ValueError(f"prompts of {ids.shape[1]} tokens exceed max_position_embeddings "
                     f"{model.config.max_position_embeddings}")
  tokens = {m.name: [] for m in modes}
  attended = {m.name: [] for m in modes}
  touched = {m.name: [] for m in modes}
  mass = {m.name: [] for m in modes}  # [layers, prompts]
  prefill_s, start = 0.0, time.perf_counter()
  for lo in range(0, len(ids), batch_size):
    chunk = ids[lo:lo + batch_size]
    n = len(chunk)  # a short last batch is padded with copies (one compiled shape)
    chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - n, axis=0)])
    out, seconds = generate(model, chunk, modes, block_size)
    prefill_s += seconds
    for name, o in out.items():
      tokens[name].append(o.tokens[:n])
      attended[name].append(o.attended[:n])
      touched[name].append(o.touched[:n])
      mass[name].append(o.query_mass[:, :n])
  wall_s = time.perf_counter() - start
  dense = np.concatenate(tokens[modes[0].name])
  rows = []
  for m in modes:
    t = np.concatenate(tokens[m.name])
    answers = [(tokenizer.decode(row).split() or [""])[0] for row in t]
    right = [a == p.answer for a, p in zip(answers, prompts)]
    rows.append(dict(
        mode=m.name, selection=None if m.blocks is None else m.selection,
        bounds_dtype=None if m.blocks is None else m.bounds_dtype,
        top_k_tokens=None if m.blocks is None else m.blocks.top_k_blocks * block_size,
        top_k_blocks=None if m.blocks is None else m.blocks.top_k_blocks,
        num_right=sum(right), num_prompts=len(prompts), accuracy=sum(right) / len(prompts),
        first_token_same_as_dense=int((t[:, 0] == dense[:, 0]).sum()),
        blocks_attended_fraction=float(np.concatenate(attended[m.name]).mean()),
        blocks_touched_fraction=float(np.concatenate(touched[m.name]).mean()),
        query_attention_mass_per_layer=[
            round(float(x), 4) for x in np.concatenate(mass[m.name], axis=1).mean(axis=1)],
        answers=answers, right=right))
  return dict(context_len=context_len, prompt_tokens=int(ids.shape[1]),
              num_blocks=-(-int(ids.shape[1]) // block_size), prompt_seed=seed,
              wall_s=round(wall_s, 2), prefill_s=round(prefill_s, 2), rows=rows)


def paired(results: Sequence[Mapping]) -> list[dict]:
  """Per context length and budget, the prompts only one selection got right (the
  discordant pairs of a paired comparison on the same prompts; equal prompts, so a
  difference in accuracy is exactly their difference)."""
  out = []
  for res in results:
    by_budget: dict[int, dict[str, list[bool]]] = {}
    for r in res["rows"]:
      if r["selection"] is not None and r.get("bounds_dtype", "float32") == "float32":
        by_budget.setdefault(r["top_k_tokens"], {})[r["selection"]] = r["right"]
    for k, sel in sorted(by_budget.items()):
      if set(sel) == {"shared", "per_kv_head"}:
        pairs = list(zip(sel["shared"], sel["per_kv_head"]))
        out.append(dict(prompt_tokens=res["prompt_tokens"], top_k_tokens=k,
                        only_per_kv_head_right=sum(h and not s for s, h in pairs),
                        only_shared_right=sum(s and not h for s, h in pairs)))
  return out


def format_table(results: Sequence[Mapping]) -> str:
  headers = ["context", "mode", "right", "accuracy", "1st tok = dense", "blocks attended",
             "blocks touched", "query attn mass (per layer)"]
  rows = []
  for res in results:
    for r in res["rows"]:
      kept = " / ".join(f"{x:.1%}" for x in r["query_attention_mass_per_layer"])
      rows.append([res["prompt_tokens"], r["mode"], f"{r['num_right']}/{r['num_prompts']}",
                   f"{r['accuracy']:.1%}", f"{r['first_token_same_as_dense']}/{r['num_prompts']}",
                   f"{r['blocks_attended_fraction']:.1%}",
                   f"{r['blocks_touched_fraction']:.1%}", kept])
  return common.format_table(headers, rows)


_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags() -> None:
  """Defines this script's absl flags (only when run as a script: importing the module,
  e.g. from a test, must not clash with the flags of other benches)."""
  _FLAGS.update(
      num_prompts=flags.DEFINE_integer("num_prompts", 100, "Retrieval prompts per length."),
      context_lens=flags.DEFINE_list("context_lens", ["512", "1024"],
                                     "Tokens each prompt fills (at most; whole lines)."),
      prompt_seed=flags.DEFINE_integer("prompt_seed", 4243, "Prompt seed (not a training "
                                       "seed), the same for every context length."),
      top_k_tokens=flags.DEFINE_list("top_k_tokens", ["256", "512"], "HiSparse budgets "
                                     "(sink and local blocks included)."),
      sink_tokens=flags.DEFINE_integer("sink_tokens", 16, "Sink tokens (part of the budget)."),
      local_tokens=flags.DEFINE_integer("local_tokens", 64, "Local tokens (part of the "
                                        "budget)."),
      block_size=flags.DEFINE_integer("block_size", 16, "Tokens per KV block."),
      selections=flags.DEFINE_list("selections", list(SELECTIONS), "Selections to run."),
      bounds_dtypes=flags.DEFINE_list("bounds_dtypes", ["float32"], "Key-bounds dtypes to "
                                      "run (float32, bfloat16): each a mode per budget."),
      batch_size=flags.DEFINE_integer("batch_size", 10, "Prompts decoded together."),
      out=flags.DEFINE_string("out", "results/selection_accuracy_cpu.json", "JSON output."))


def main(argv):
  del argv
  import models  # noqa: PLC0415
  from models.loader import load_pretrained  # noqa: PLC0415

  f = {name: holder.value for name, holder in _FLAGS.items()}
  block_size = f["block_size"]
  modes = make_modes([int(k) for k in f["top_k_tokens"]], f["sink_tokens"],
                     f["local_tokens"], block_size, f["selections"], f["bounds_dtypes"])
  model, _, tokenizer = load_pretrained()
  start = time.perf_counter()
  results = []
  for length in (int(x) for x in f["context_lens"]):
    res = evaluate(model, tokenizer, length, f["num_prompts"], f["prompt_seed"], modes,
                   block_size, f["batch_size"])
    results.append(res)
    print(f"context {res['prompt_tokens']} tokens ({res['num_blocks']} blocks): "
          f"{res['wall_s']:.1f} s ({res['prefill_s']:.1f} s prefill)", file=sys.stderr)
  total_s = time.perf_counter() - start
  print(format_table(results))
  comparison = paired(results)
  for c in comparison:
    print(f"context {c['prompt_tokens']}, top_k {c['top_k_tokens']}: only per_kv_head right "
          f"{c['only_per_kv_head_right']}, only shared right {c['only_shared_right']}")
  report = dict(machine=common.machine(), jax_version=jax.__version__,
                checkpoint=checkpoint_info(models.DEFAULT_MODEL_DIR), flags=f,
                max_new_tokens=MAX_NEW_TOKENS, greedy=True,
                sparse_steps="the prompt's last token and the generated tokens but the last",
                total_s=round(total_s, 1), results=results, paired=comparison)
  print(f"checkpoint: {json.dumps(report['checkpoint'])}; {total_s:.0f} s in all")
  os.makedirs(os.path.dirname(f["out"]) or ".", exist_ok=True)
  with open(f["out"], "w") as fh:
    json.dump(report, fh, indent=2)
    fh.write("\n")
  print(f"wrote {f['out']}", file=sys.stderr)


if __name__ == "__main__":
  define_flags()
  app.run(main)
