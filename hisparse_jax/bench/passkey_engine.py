"""The engines of the passkey suite (passkey.py) and what it reads from them: an Engine over
a loaded model with a device pool sized to force offloads (`device_pool_blocks`,
`make_engine`), greedy generation whose prompt tail is computed by decode steps
(`forced_generate`: teacher forcing through the Engine API), the host-pool, capacity and
checkpoint figures of a row, and the release of compiled programs between rows. passkey.py
holds the grid, the rows and the report; this module knows nothing of them.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os

import jax

GIB = 2**30

# Device blocks beyond one request and one hot buffer (fraction of a request): the prefix
# blocks an offloaded request shares with the next (its needle depth, 10% at the least)
# stay on the device, plus a spare block per running request.
OFFLOAD_SLACK = 0.25


def device_pool_blocks(max_model_len: int, block_size: int, device_requests: float,
                       hot_buffer_tokens: int | None) -> int:
  """Usable device blocks of a row (passkey.py's docstring, "Host loads"): `device_requests`
  requests of max_model_len tokens, or for HiSparse, where more, one request plus an
  offloaded request's hot buffer plus OFFLOAD_SLACK of a request."""
  per_request = math.ceil(max_model_len / block_size)
  blocks = math.ceil(device_requests * per_request)
  if hot_buffer_tokens is not None:
    blocks = max(blocks, per_request + math.ceil(hot_buffer_tokens / block_size)
                 + math.ceil(OFFLOAD_SLACK * per_request))
  return blocks


def make_engine(bundle, model_name: str, *, max_model_len: int, block_size: int, hisparse,
                num_requests: int, device_requests: float, streamed: bool = False):
  """An Engine over the loaded model (`bundle`: load_pretrained's (model, config,
  tokenizer) of the preset `model_name`): the device pool holds `device_requests` requests of
  max_model_len tokens in blocks (+ HiSparse's reserved bytes), the host pool all of them.
  `streamed`: exactly `device_requests` (< 1) of a request, no hot-buffer room added."""
  from hisparse_jax.engine.config import EngineConfig  # noqa: PLC0415
  from hisparse_jax.engine.engine import Engine  # noqa: PLC0415
  from hisparse_jax.kv_cache.capacity import hisparse_capacity  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415

  model, model_config, tokenizer = bundle
  spec = KVCacheSpec.from_model_config(model_config, "float32", block_size)
  blocks_per_request = math.ceil(max_model_len / block_size)
  device_blocks = device_pool_blocks(
      max_model_len, block_size, device_requests,
      None if hisparse is None else hisparse.hot_buffer_tokens) + 1  # + the null block
  max_num_batched_tokens = 2048  # (EngineConfig's default)
  if streamed:  # prefill chunks that fit beside the hot buffer (streamed_device_blocks)
    device_blocks = math.floor(device_requests * blocks_per_request) + 1
    hot_blocks = hisparse.blocks(block_size).hot_buffer_blocks
    max_num_batched_tokens = min(max_num_batched_tokens,
                                 (device_blocks - 1 - hot_blocks - 2) * block_size)
  host_blocks = (num_requests + 2) * blocks_per_request + 1
  max_num_seqs = max(8, num_requests)
  reserved = 0
  if hisparse is not None:
    reserved = hisparse_capacity(spec, hisparse, num_device_blocks=device_blocks,
                                 num_host_blocks=host_blocks, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len).reserved_bytes
  config = EngineConfig(
      model=model_name, block_size=block_size, max_model_len=max_model_len,
      max_num_seqs=max_num_seqs, hisparse=hisparse,
      max_num_batched_tokens=max_num_batched_tokens,
      device_kv_gib=(device_blocks * spec.bytes_per_block + reserved + 512) / GIB,
      host_pool_gib=(host_blocks * spec.bytes_per_block + 512) / GIB,
      # Teacher forcing overwrites a sampled token before the next step takes it.
      async_scheduling=False)
  return Engine(config, model=model, model_config=model_config, tokenizer=tokenizer)


def forced_generate(engine, prompts, num_forced: int, new_tokens: int
                    ) -> list[tuple[list[int], object]]:
  """Greedy generation where the last `num_forced` tokens of each prompt are computed by
  decode steps (passkey.py's docstring): the engine gets each prompt without them, and every
  token it samples in their place is overwritten with the prompt's own before the next
  step. Returns, per prompt, the `new_tokens` tokens generated after the whole prompt and
  the final RequestOutput (its metrics)."""
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415

  if num_forced < 1:
    raise ValueError(f"num_forced must be >= 1, got {num_forced}")
  params = SamplingParams(max_tokens=num_forced + new_tokens, temperature=0.0, ignore_eos=True)
  forced, done, ids = {}, {}, []
  for i, prompt in enumerate(prompts):
    rid = f"passkey-{i}"
    engine.add_request(rid, prompt_token_ids=list(prompt[:-num_forced]), sampling_params=params)
    forced[rid] = list(prompt[-num_forced:])
    ids.append(rid)
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        done[out.request_id] = out
    for rid, tail in list(forced.items()):
      request = engine.requests.get(rid)
      if request is None:
        continue
      output = request.output_token_ids
      for j in range(min(len(output), len(tail))):
        output[j] = tail[j]  # what the next decode step computes
      if len(output) >= len(tail):
        del forced[rid]
  results = []
  for rid, prompt in zip(ids, prompts):
    tokens = list(done[rid].outputs[0].token_ids)
    assert tokens[:num_forced] == list(prompt[-num_forced:]), (rid, tokens)
    results.append((tokens[num_forced:], done[rid]))
  return results


def host_figures(engine) -> dict:
  m = engine.metrics()
  selected = {s: m.get(f'hisparse_blocks_selected_total{{source="{s}"}}', 0.0)
              for s in ("device", "hot", "host")}
  return {"host_loads": m.get("hisparse_hot_buffer_loads_total", 0.0),
          "offloads": m.get("hisparse_offloads_total", 0.0),
          "hot_buffer_hit_ratio": m.get("hisparse_hot_buffer_hit_rate", 0.0),
          "hot_buffer_lookups": m.get("hisparse_hot_buffer_lookups_total", 0.0),
          "h2d_bytes": m.get('hisparse_transfer_bytes_total{direction="h2d"}', 0.0),
          "d2h_bytes": m.get('hisparse_transfer_bytes_total{direction="d2h"}', 0.0),
          "preemptions": m.get("hisparse_preemptions_total", 0.0),
          "prefix_cache_hits": sum(v for k, v in m.items()
                                   if k.startswith("hisparse_prefix_cache_hits_total")),
          "blocks_selected": selected}


def capacity_figures(engine) -> dict:
  return {t.memory_kind: {"blocks": t.num_blocks, "tokens": t.num_tokens,
                          "reserved_bytes": t.reserved_bytes}
          for t in engine.capacity.tiers}


def checkpoint_figures(model: str) -> dict:
  """The file measured: preset, path, the first 12 hex digits of its SHA-256."""
  from configs.models import resolve_model_path  # noqa: PLC0415

  path = resolve_model_path(model)
  weights = path if os.path.isfile(path) else os.path.join(path, "model.safetensors")
  digest = hashlib.sha256()
  with open(weights, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      digest.update(chunk)
  return {"preset": model, "file": os.path.basename(weights),
          "sha256_12": digest.hexdigest()[:12]}


def drop_programs() -> None:
  """Drops every compiled program (a row's are not reused by the next: another top-k,
  block size or length). XLA:CPU maps each executable's code into mappings of its own;
  30 layers' programs of a few dozen engines pass Linux's vm.max_map_count (65,530), and
  the next compile aborts inside LLVM ("Cannot allocate memory"), as tests/conftest.py
  says of the test suite."""
  jax.clear_caches()
  gc.collect()


def num_mappings() -> int | None:
  """Memory mappings of this process (Linux), None elsewhere."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None
