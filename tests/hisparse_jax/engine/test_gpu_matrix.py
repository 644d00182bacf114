"""The compile matrix run on a GPU: each config's engine (the toy model) decodes on the
device, and its greedy tokens are compared with the same config's engine on the CPU (a
subprocess with JAX_PLATFORMS=cpu running this file).

`make test` compiles these configs for an H200 without a GPU (test_aot_h200.py); here they
run. The configs go smallest first, so a short GPU loan answers "does it run" for each
program kind before anything slow (`make gpu-check`'s matrix step runs this file first).
Without a GPU, one test checks that every config is a valid engine that takes the path it
is meant to (offloads, host loads, streamed chunks) on the CPU; the GPU comparison skips.

    python tests/hisparse_jax/engine/test_gpu_matrix.py NAME   # the CPU side: JSON tokens
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # engine_fixtures

PROMPT_LENS = (9, 40, 70, 33)  # 70 > the device pool of the streamed config
MAX_TOKENS = 8


def _configs():
  from hisparse_jax import HiSparseConfig  # noqa: PLC0415

  sparse = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8,
                          local_tokens=8, sparse_threshold_tokens=16,
                          resident_sparse_min_tokens=0)
  common = dict(block_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16)
  # name -> (EngineConfig fields, device blocks, what must happen on the way)
  return {
      "dense_bfloat16": (dict(common, dtype="bfloat16"), 40, set()),
      # int8 KV and int8 key bounds (QuantizedBounds: block_key_bounds / block_scores).
      "hisparse_int8": (dict(common, hisparse=dataclasses.replace(sparse, bounds_dtype="int8"),
                             kv_cache_dtype="int8"), 14, {"host_loads"}),
      "streamed_prefill": (dict(common, hisparse=sparse), 8, {"host_loads", "streamed"}),
      "mosaic_gpu": (dict(common, hisparse=sparse, dtype="bfloat16",
                          kernel_backend="pallas_mgpu"), 17, {"host_loads"}),
      # fp8 indexer keys (their kernel's fp8 -> dot conversion on the device).
      "dsa_offload": (dict(common, hisparse=HiSparseConfig(indexer="lightning",
                                                           hot_buffer_tokens=16),
                           index_cache_dtype="fp8_e4m3"), 17, {"host_loads"}),
  }


def _model(name: str, dtype: str):
  import jax.numpy as jnp  # noqa: PLC0415

  if name == "dsa_offload":
    from models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: PLC0415
    from models.testing import DSA_TINY_HF_CONFIG  # noqa: PLC0415

    config = DeepseekV32Config.from_hf_dict(dict(DSA_TINY_HF_CONFIG,
                                                 model_type="deepseek_v32"))
    return DeepseekV32ForCausalLM(config, dtype=jnp.dtype(dtype), seed=0)
  from engine_fixtures import tiny_config  # noqa: PLC0415

  from models.llama import LlamaForCausalLM  # noqa: PLC0415

  return LlamaForCausalLM(tiny_config(head_dim=32), dtype=jnp.dtype(dtype), seed=0)


def run_config(name: str, platform: str | None = None) -> dict:
  """The config's engine over PROMPT_LENS prompts, greedy: {"tokens", "events"}."""
  from engine_fixtures import random_prompts  # noqa: PLC0415

  from hisparse_jax.engine.engine import Engine, EngineConfig  # noqa: PLC0415
  from hisparse_jax.engine.planning import (  # noqa: PLC0415
    check_model_kind,
    hisparse_capacity_for,
  )
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec, MLACacheSpec  # noqa: PLC0415

  fields, device_blocks, _ = _configs()[name]
  if platform == "cpu" and fields.get("kernel_backend") == "pallas_mgpu":
    fields = dict(fields, kernel_backend=None)  # (its reference: the CPU's kernels)
  dtype = fields.get("dtype", "float32")
  model = _model(name, dtype)
  spec_cls = MLACacheSpec if name == "dsa_offload" else KVCacheSpec
  spec = spec_cls.from_model_config(model.config, dtype, fields["block_size"], **(
      {"index_cache_dtype": fields["index_cache_dtype"]} if "index_cache_dtype" in fields
      else {}))
  host_blocks, gib = 80, 2**30
  # A budget of exactly `device_blocks` blocks beside what HiSparse reserves for them.
  config = check_model_kind(EngineConfig(**fields), model.config, name == "dsa_offload")
  reserved = (0 if config.hisparse is None else hisparse_capacity_for(
      config, spec, device_blocks, host_blocks).reserved_bytes)
  config = EngineConfig(**fields, device_kv_gib=(
      (device_blocks + 0.5) * spec.bytes_per_block + reserved) / gib,
                        host_pool_gib=(host_blocks + 0.5) * spec.bytes_per_block / gib)
  engine = Engine(config, model=model, model_config=model.config)
  vocab = model.config.vocab_size
  prompts = [[int(t) % (vocab - 2) + 2 for t in p]
             for p in random_prompts(PROMPT_LENS, seed=1)]
  for i, p in enumerate(prompts):
    engine.add_request(str(i), prompt_token_ids=p,
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True))
  outs, host_selected, streamed = {}, 0, False
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        outs[out.request_id] = out.outputs[0].token_ids
    for request in engine.requests.values():  # (a finished one has left: seen before)
      host_selected = max(host_selected, request.blocks_selected["host"])
      streamed |= request.streamed
  events = set()
  if host_selected > 0:
    events.add("host_loads")
  if streamed:
    events.add("streamed")
  return {"tokens": [list(map(int, outs[str(i)])) for i in range(len(prompts))],
          "events": sorted(events), "platform": jax.default_backend()}


@pytest.mark.parametrize("name", list(_configs()))
def test_the_gpu_runs_the_config_with_the_cpu_engines_tokens(name):
  if jax.default_backend() != "gpu":
    pytest.skip("runs the compiled programs on a GPU (make gpu-check); here `make test` "
                "compiles them for an H200 (test_aot_h200.py)")
  gpu = run_config(name)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, os.path.abspath(__file__), name], env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  cpu = json.loads(r.stdout.strip().splitlines()[-1])
  assert cpu["platform"] == "cpu"
  assert set(_configs()[name][2]) <= set(gpu["events"]), gpu["events"]
  same = np.mean([g == c for gr, cr in zip(gpu["tokens"], cpu["tokens"])
                  for g, c in zip(gr, cr)])
  # float32: the same greedy tokens; bfloat16 steps round differently on the two
  # devices' kernels, so a late token may flip between near-equal logits.
  floor = 1.0 if _configs()[name][0].get("dtype", "float32") == "float32" else 0.9
  assert same >= floor, (name, gpu["tokens"], cpu["tokens"])


def test_every_config_takes_its_path_on_this_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU side runs in the GPU test's subprocess")
  for name, (_, _, events) in _configs().items():
    if name in ("mosaic_gpu", "dense_bfloat16"):
      continue  # (the same engines as others here: the CPU runs no Mosaic GPU kernel)
    result = run_config(name, "cpu")
    assert events <= set(result["events"]), (name, result["events"])
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])


if __name__ == "__main__":
  print(json.dumps(run_config(sys.argv[1], "cpu")))
