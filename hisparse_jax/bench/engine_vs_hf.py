"""Suite `engine_vs_hf`: greedy generation on the default model, three ways, same prompts.

    engine      hisparse_jax Engine: add 8 requests, step until done (paged KV, one jitted
                step per token for the whole batch)
    hf          transformers `generate` (torch, CPU) on the same checkpoint directory
    dense_jax   a plain JAX loop over the same Flax model: a contiguous KV array per layer
                [batch, prompt + new, kv_heads, head_dim], prefill then `lax.scan` over the
                decode steps, all in one jitted call, models/attention.py's dense attention

Batch 8 x 128 new tokens (greedy, no early stop), prompts = retrieval prompts of
`prompt_len` tokens. Each contender runs once to warm up (compile; other prompts of the
same shape, so the engine's prefix cache cannot help) and then `reps` times interleaved;
time = prompt in -> all tokens out, prefill included. JSON: `tokens_per_s_ratio_vs_hf`
and `tokens_per_s_ratio_vs_dense_jax` (engine tokens/s over theirs), whether the three
produced the same tokens, and `profile`: the engine's time per step on the host (its
steps overlap: the host plans step t while the device runs step t - 1) and waiting for
the device, and its attention kernel against the paged decode kernel at the shapes of
its last decode step.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.bench import common
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from models import data
from models.attention import dense_causal_attention


@dataclasses.dataclass(frozen=True)
class Size:
  batch: int
  new_tokens: int
  prompt_len: int
  reps: int
  warmup: bool = True  # one untimed run of each first (compiles); off in smoke runs


SIZES = {
    "full": Size(batch=8, new_tokens=128, prompt_len=256, reps=5),
    "smoke": Size(batch=2, new_tokens=4, prompt_len=24, reps=1, warmup=False),
}


def _cache_attn_fn(q, k, v, *, layer_idx, kv_cache, metadata, config):
  """`AttnFn` over a contiguous cache: write k/v at `metadata` (the first position of
  this call), attend causally over the whole cache (unwritten keys are in the future)."""
  del layer_idx
  k_cache, v_cache = kv_cache
  start = metadata
  k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
  v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
  batch, seq = q.shape[:2]
  q_positions = jnp.broadcast_to(start + jnp.arange(seq), (batch, seq))
  k_positions = jnp.broadcast_to(jnp.arange(k_cache.shape[1]), (batch, k_cache.shape[1]))
  out = dense_causal_attention(q, k_cache, v_cache, q_positions=q_positions,
                               k_positions=k_positions, sliding_window=config.sliding_window)
  return out, (k_cache, v_cache)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _dense_generate(graphdef, params, prompts, num_new: int):
  """Greedy tokens [batch, num_new]: prefill, then a scan of one-token decode steps."""
  model = nnx.merge(graphdef, params)
  config = model.config
  batch, prompt_len = prompts.shape
  shape = (batch, prompt_len + num_new, config.num_key_value_heads, config.head_dim)
  dtype = model.embed_tokens[...].dtype
  caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(config.num_hidden_layers)]
  positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
  hidden, caches = model.hidden_states(prompts, positions, attn_fn=_cache_attn_fn,
                                       kv_caches=caches, attn_metadata=jnp.int32(0))
  first = jnp.argmax(model.compute_logits(hidden[:, -1]), axis=-1).astype(jnp.int32)

  def decode(carry, i):
    token, caches = carry
    pos = prompt_len + i
    hidden, caches = model.hidden_states(token[:, None], jnp.full((batch, 1), pos),
                                         attn_fn=_cache_attn_fn, kv_caches=caches,
                                         attn_metadata=pos)
    nxt = jnp.argmax(model.compute_logits(hidden[:, 0]), axis=-1).astype(jnp.int32)
    return (nxt, caches), nxt

  _, rest = jax.lax.scan(decode, (first, caches), jnp.arange(num_new - 1, dtype=jnp.int32))
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def _prompts(tokenizer, size: Size, seed: int) -> np.ndarray:
  prompts = data.make_retrieval_prompts(size.batch, size.prompt_len, seed=seed)
  ids = [tokenizer.encode(p.text) for p in prompts]
  n = min(len(x) for x in ids)
  return np.asarray([x[len(x) - n:] for x in ids], np.int32)  # same length: no padding


def _engine_generate(engine: Engine, prompts: np.ndarray, num_new: int) -> np.ndarray:
  params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
  ids = [engine.add_request(prompt_token_ids=p.tolist(), sampling_params=params)
         for p in prompts]
  tokens = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        tokens[out.request_id] = out.outputs[0].token_ids
  return np.asarray([tokens[i] for i in ids], np.int32)


def _attention_profile(engine: Engine, batch, reps: int) -> dict:
  """Attention of one layer at the shapes of the engine's last (decode) step: the ragged
  kernel the step calls (with the step's static sizes) against the paged decode kernel
  (one query per sequence) over the same block tables."""
  ops = engine.runner.ops
  meta = batch.metadata
  num_seqs = batch.num_seqs
  config = engine.model_config
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((batch.input_ids.shape[0], config.num_attention_heads,
                                       config.head_dim)), jnp.float32)
  pool = engine.device_pool
  k, v = pool.from_storage(pool.k[0]), pool.from_storage(pool.v[0])
  tables, kv_lens = jnp.asarray(meta.block_tables), jnp.asarray(meta.kv_lens)
  cu_q_lens = jnp.asarray(meta.cu_q_lens)
  hints = dict(meta.ragged_hints)  # the static sizes the step passed
  times = common.interleaved({
      "ragged_paged_attention (what the step calls)":
          lambda: ops.ragged_paged_attention(q, k, v, tables, kv_lens, cu_q_lens, **hints),
      "paged_attention (one query per sequence)":
          lambda: ops.paged_attention(q[:num_seqs], k, v, tables[:num_seqs],
                                      kv_lens[:num_seqs])}, max(reps, 20))
  return {name: common.median(t) * 1e3 for name, t in times.items()}


def run(size_name: str = "full", seed: int = 0) -> dict:
  size = SIZES[size_name]
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ValueError(f"engine_vs_hf needs torch and transformers (pip install "
                     f"'hisparse-jax[parity]'): {e}") from None
  import models
  from models.loader import load_pretrained

  transformers.logging.set_verbosity_error()  # generate's notes on max_length, not results
  transformers.utils.logging.disable_progress_bar()
  model, model_config, tokenizer = load_pretrained(None)
  max_model_len = size.prompt_len + size.new_tokens
  engine = Engine(EngineConfig(max_model_len=max_model_len, max_num_seqs=size.batch,
                               max_num_batched_tokens=size.batch * size.prompt_len,
                               device_kv_gib=0.05, host_pool_gib=0.01, seed=seed),
                  model=model, model_config=model_config, tokenizer=tokenizer)
  hf = transformers.AutoModelForCausalLM.from_pretrained(models.DEFAULT_MODEL_DIR,
                                                         dtype=torch.float32).eval()
  graphdef, params = nnx.split(model)
  # Steps overlap: the host waits for the device only in `collect` (time not hidden
  # behind host work); `dispatch` starts each step.
  dispatch = engine.runner.dispatch = common.CallTimer(engine.runner.dispatch)
  collect = engine.runner.collect = common.CallTimer(engine.runner.collect)

  def hf_generate(prompts):
    with torch.no_grad():
      out = hf.generate(torch.as_tensor(prompts, dtype=torch.long),
                        attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                        do_sample=False, max_new_tokens=size.new_tokens,
                        min_new_tokens=size.new_tokens, pad_token_id=0, eos_token_id=None)
    return out[:, prompts.shape[1]:].numpy()

  contenders = {
      "engine": lambda p: _engine_generate(engine, p, size.new_tokens),
      "hf": hf_generate,
      "dense_jax": lambda p: np.asarray(_dense_generate(graphdef, params, jnp.asarray(p),
                                                        size.new_tokens)),
  }
  if size.warmup:
    warm = _prompts(tokenizer, size, seed + 1)
    for fn in contenders.values():
      fn(warm)
  prompts = _prompts(tokenizer, size, seed)
  outputs = {}

  engine_runs = []  # (engine steps, seconds waiting for the device) of each timed run

  def thunk(name):
    def call():
      outputs[name] = contenders[name](prompts)
      if name == "engine":
        engine_runs.append((len(dispatch.seconds), collect.take()))
        dispatch.take()
    return call

  dispatch.take()
  collect.take()
  times = common.interleaved({name: thunk(name) for name in contenders}, size.reps, warmup=0)
  num_tokens = size.batch * size.new_tokens
  rows = {name: {"seconds": common.median(t), "tokens_per_s": num_tokens / common.median(t)}
          for name, t in times.items()}
  same = {other: float(np.mean(np.all(outputs["engine"] == outputs[other], axis=1)))
          for other in ("hf", "dense_jax")}
  # The split of the engine's median run: time in the jitted step vs on the host.
  median_run = int(np.argsort(times["engine"])[len(engine_runs) // 2])
  engine_s = times["engine"][median_run]
  engine_steps, wait_s = engine_runs[median_run]
  profile = {
      "engine_steps": engine_steps,
      "engine_wait_ms_per_step": wait_s / engine_steps * 1e3,
      "engine_host_ms_per_step": (engine_s - wait_s) / engine_steps * 1e3,
      "hf_ms_per_token_step": common.median(times["hf"]) / size.new_tokens * 1e3,
      "dense_jax_ms_per_token_step": common.median(times["dense_jax"]) / size.new_tokens * 1e3,
      "attention_ms_per_layer": _attention_profile(engine, dispatch.last_args[0], size.reps)}
  return {
      "tokens_per_s_ratio_vs_hf": rows["engine"]["tokens_per_s"] / rows["hf"]["tokens_per_s"],
      "tokens_per_s_ratio_vs_dense_jax": (rows["engine"]["tokens_per_s"]
                                          / rows["dense_jax"]["tokens_per_s"]),
      "goal_vs_hf_cpu": 1.0,
      "sequences_identical_to_engine": same, "rows": rows, "profile": profile,
      "config": dataclasses.asdict(size),
      "prompt_tokens": int(prompts.shape[1]), "model": "hisparse-tiny (default)",
      "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
      "transformers_version": transformers.__version__, "cpu_count": os.cpu_count()}


def format_table(result: dict) -> str:
  rows = [(name, r["seconds"], r["tokens_per_s"]) for name, r in result["rows"].items()]
  c, p = result["config"], result["profile"]
  same = ", ".join(f"{k} {100 * v:.0f}%"
                   for k, v in result["sequences_identical_to_engine"].items())
  return (common.format_table(["generator", "s", "tokens/s"], rows)
          + f"\nbatch {c['batch']} x {c['new_tokens']} new tokens, prompts of "
          f"{result['prompt_tokens']} tokens; engine/hf {result['tokens_per_s_ratio_vs_hf']:.2f}, "
          f"engine/dense_jax {result['tokens_per_s_ratio_vs_dense_jax']:.2f}; sequences "
          f"identical to the engine's: {same}\n"
          f"engine per step: {p['engine_host_ms_per_step']:.2f} ms host (overlapping the "
          f"device) + {p['engine_wait_ms_per_step']:.2f} ms waiting for the device "
          f"({p['engine_steps']} steps); hf "
          f"{p['hf_ms_per_token_step']:.2f} ms, dense_jax {p['dense_jax_ms_per_token_step']:.2f} "
          "ms per token step; attention per layer at the decode step's shapes: " + ", ".join(
              f"{k} {v:.2f} ms" for k, v in p["attention_ms_per_layer"].items()))
