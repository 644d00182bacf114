"""The real-model part of `hisparse-jax demo` (see demo.py, which dispatches here): a chat
answer and passkey retrievals under HiSparse with a device pool too small for all of them
(sizes from demo_common.py)."""

from __future__ import annotations

import dataclasses

from absl import flags

from hisparse_jax.entrypoints.cli import generate as generate_cmd
from hisparse_jax.entrypoints.cli.demo_common import demo_settings, host_pool_line

FLAGS = flags.FLAGS
NUM_PROMPTS = 3
CONTEXT_LEN = 3968  # ~4k tokens: 8 new tokens fit a 4,000-token request
# The device pool holds this many of the passkey prompts (+ one block each): two do not
# fit, so the scheduler offloads decoding requests to admit the next (host-backed
# admission).
DEVICE_POOL_PROMPTS = 1.75
MAX_NEW_TOKENS = 8  # the 5 digits and a full stop
CHAT = ("What is the capital of France?", "The capital of France is Paris")
# HiSparse on the real model (a flag given explicitly overrides each): 16-token blocks, a
# quarter of a ~4k prompt attended per sparse step (sink 64 + local 256 + the indexer's
# picks), a hot buffer as large, requests past 1,024 tokens decode sparsely (the passkey
# prompts, not the chat). An offloaded request then holds 64 + 1 device blocks instead of
# ~248, so the pool of 1.75 prompts runs all three.
REAL_HISPARSE = dict(top_k_tokens=1024, hot_buffer_tokens=1024, sink_tokens=64,
                     local_tokens=256, sparse_threshold_tokens=1024)


def real_demo() -> int:
  from hisparse_jax.kv_cache.capacity import hisparse_capacity  # noqa: PLC0415 (jax)
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from models import passkey  # noqa: PLC0415
  from models.loader import checkpoint_dtype, load_config, load_tokenizer  # noqa: PLC0415

  model = FLAGS.model
  num_prompts = FLAGS.demo_num_prompts or NUM_PROMPTS
  context_len = FLAGS.demo_context_len or CONTEXT_LEN
  tokenizer = load_tokenizer(model)
  depths = ([0.5] if num_prompts == 1
            else [0.1 + 0.8 * i / (num_prompts - 1) for i in range(num_prompts)])
  prompts = passkey.make_passkey_prompts(tokenizer, context_len, depths, seed=FLAGS.demo_seed)
  prompt_len = max(len(p.token_ids) for p in prompts)
  use_hisparse = FLAGS.hisparse or not FLAGS["hisparse"].present  # on unless --nohisparse
  if use_hisparse:
    FLAGS.hisparse = True
    for name, value in REAL_HISPARSE.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value
  dtype = checkpoint_dtype(model) if FLAGS.dtype == "auto" else FLAGS.dtype
  spec = KVCacheSpec.from_model_config(load_config(model), dtype,
                                       generate_cmd.block_size_from_flags())
  hisparse = generate_cmd.hisparse_from_flags()
  max_num_seqs = FLAGS.max_num_seqs if FLAGS["max_num_seqs"].present else 8

  def reserved_bytes(device_blocks: int, host_blocks: int, max_model_len: int) -> int:
    if hisparse is None:
      return 0
    return hisparse_capacity(spec, hisparse, num_device_blocks=device_blocks,
                             num_host_blocks=host_blocks, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len).reserved_bytes

  max_new = FLAGS.max_new_tokens if FLAGS["max_new_tokens"].present else MAX_NEW_TOKENS
  chosen = demo_settings(prompt_len, spec.bytes_per_token, spec.block_size, num_prompts,
                         max_new, reserved_bytes, device_pool_prompts=DEVICE_POOL_PROMPTS)
  llm_kwargs = generate_cmd.engine_kwargs_from_flags()
  llm_kwargs["max_num_seqs"] = max_num_seqs
  # The passkey prompts share their filler up to the first needle: with prefix caching
  # they would share those blocks and fit the device pool together (nothing offloaded).
  llm_kwargs["enable_prefix_caching"] = False
  for name in ("max_model_len", "device_kv_gib", "host_pool_gib"):
    if not FLAGS[name].present:
      llm_kwargs[name] = chosen[name]
  # Greedy; "." ends an answer (the reply's sentence, the key before "Remember it.").
  sampling_params = dataclasses.replace(generate_cmd.sampling_from_flags(),
                                        max_tokens=max_new, stop=["."])
  specs = []
  if tokenizer.chat_template is not None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT[0]}],
                                         add_generation_prompt=True)
    specs.append(generate_cmd.PromptSpec(
        source="chat", prompt_token_ids=tokenizer.encode(text, add_special_tokens=False),
        expected=CHAT[1], max_tokens=32))
  specs += [generate_cmd.PromptSpec(source=f"passkey {i}", prompt=p.text, expected=p.key)
            for i, p in enumerate(prompts)]
  how = (f"HiSparse top-k {hisparse.top_k_tokens} tokens, hot buffer "
         f"{hisparse.hot_buffer_tokens} tokens, sink {hisparse.sink_tokens}, local "
         f"{hisparse.local_tokens}, sparse past {hisparse.sparse_threshold_tokens} tokens"
         if hisparse is not None else "dense attention (--nohisparse)")
  print(f"demo: {model} ({how}); [0] a chat reply, then {num_prompts} passkey prompts of "
        f"{prompt_len:,} tokens with 5-digit keys at depths "
        f"{', '.join(f'{d:.0%}' for d in depths)}, all at once over a device KV pool of "
        f"about {DEVICE_POOL_PROMPTS:g} of them (prefix caching off: the prompts share their "
        "filler)", flush=True)
  result = generate_cmd.run(specs, llm_kwargs, sampling_params,
                            log_every_steps=FLAGS.log_every_steps,
                            metrics_json=FLAGS.metrics_json,
                            prometheus_port=FLAGS.prometheus_port,
                            **generate_cmd.dashboard_from_flags())
  print(host_pool_line(result), flush=True)
  print(f"try it yourself: hisparse-jax generate --model={model} --chat "
        "--prompt='Name three colors of the rainbow.' --max_new_tokens=48", flush=True)
  return 0
