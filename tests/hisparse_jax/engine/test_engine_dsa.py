"""DSA models (DeepSeek-V3.2, GLM-MoE-DSA) through the engine, against transformers' eager
implementation on the same random checkpoints (models.testing.save_random_dsa: index_topk
8, shorter than every prompt, so the learned indexer's sparsity is active in prefill and
decode; GLM: layers 1 and 3 reuse the previous layer's selection).

The engine keeps the MLA latent and the indexer keys in paged caches (block size 4) and
attends each query's selected tokens (sparse/dsa_attention.py); a batch of mixed prompt
lengths (one shorter than index_topk) decodes 32 greedy tokens each. With HiSparse
(`indexer="lightning"`) over a device pool smaller than the batch's KV, long decoders are
offloaded: their full caches stay in the pinned_host pool, their selected tokens come
from a token-granular hot buffer or are loaded from the host inside the step.
"""

import functools
import json
import re

import numpy as np
import pytest
import torch
from absl.testing import absltest  # noqa: F401 (absl logging for the capacity lines)
from engine_fixtures import run_alone
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST
from models import deepseek_v32_checkpoint, testing
from models.loader import CheckpointError

KINDS = ("deepseek_v32", "glm_moe_dsa")
INDEXERS = {"deepseek_v32": hf_ds.DeepseekV32Indexer, "glm_moe_dsa": hf_glm.GlmMoeDsaIndexer}
PROMPT_LENS = (20, 13, 27, 5)
NUM_GREEDY = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
GIB = 2**30
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
# A hot buffer of 16 token slots (index_topk 8): offloaded decoders evict and reload.
LIGHTNING = HiSparseConfig(indexer="lightning", hot_buffer_tokens=16,
                           sparse_threshold_tokens=16)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # (its tiny ops: ~30x faster than two threads spinning here)
  yield
  torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
  """(kind, path, HF eager model, our model, prompts, HF's greedy tokens of each)."""
  kind = request.param
  path = tmp_path_factory.mktemp(kind) / "ckpt"
  hf = testing.save_random_dsa(path, kind)
  model, _ = deepseek_v32_checkpoint.load_pretrained(path)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(2, 97, size=n).tolist() for n in PROMPT_LENS]
  greedy = []
  with torch.no_grad():
    for p in prompts:
      out = hf.generate(torch.as_tensor([p]), do_sample=False, max_new_tokens=NUM_GREEDY,
                        min_new_tokens=NUM_GREEDY, pad_token_id=0, eos_token_id=None)
      greedy.append(out[0, len(p):].tolist())
  return kind, path, hf, model, prompts, greedy


def _engine(model, *, device_kv_gib=0.001, host_pool_gib=0.0004, **overrides):
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=32, device_kv_gib=device_kv_gib,
                host_pool_gib=host_pool_gib)
  return Engine(EngineConfig(**{**fields, **overrides}), model=model, model_config=model.config)


def _run(engine, prompts):
  for i, p in enumerate(prompts):
    engine.add_request(str(i), prompt_token_ids=p, sampling_params=GREEDY)
  outputs = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        assert out.outputs[0].finish_reason == "length", out.error
        outputs[out.request_id] = out.outputs[0].token_ids
    engine.check_invariants()
  return [outputs[str(i)] for i in range(len(prompts))]


def _record_selections(engine):
  """Every step's (chunks as (request id, first position, tokens), cu_q_lens, selections
  [layers, tokens, k]), recorded as the steps run."""
  runner = engine.runner
  runner.set_record_topk(True)
  built, steps = [], []
  build, collect = runner.build_batch, runner.collect

  def recording_build(chunks, tables, tiers=None):
    batch = build(chunks, tables, tiers)
    built.append(([(c.request.request_id, c.start, c.num_tokens) for c in chunks],
                  np.asarray(batch.metadata.cu_q_lens)))
    return batch

  def recording_collect(handle):
    result = collect(handle)
    steps.append((*built[len(steps)], result.topk))
    return result

  runner.build_batch, runner.collect = recording_build, recording_collect
  return steps


def _hf_selections(hf, kind, ids):
  """Per indexer layer, int32 [seq, k] of HF's indexer over the full sequence `ids`."""
  cls, caught = INDEXERS[kind], []
  forward = cls.forward

  def hooked(self, *args, **kwargs):
    out = forward(self, *args, **kwargs)
    caught.append(out[0].numpy()[0] if out[0].ndim == 3 else out[0].numpy())
    return out

  cls.forward = hooked
  try:
    with torch.no_grad():
      hf(torch.as_tensor([ids]))
  finally:
    cls.forward = forward
  return caught


def _causal_set(row, position):
  return sorted(int(t) for t in row if 0 <= t <= position)


def test_greedy_and_every_selection_equal_transformers(checkpoint):
  kind, _, hf, model, prompts, greedy = checkpoint
  engine = _engine(model)
  assert engine.is_dsa and engine.device_pool.spec.is_mla
  steps = _record_selections(engine)
  outputs = _run(engine, prompts)
  assert outputs == greedy
  indexer_layers = [i for i, t in enumerate(model.config.indexer_types) if t == "full"]
  refs = [_hf_selections(hf, kind, p + o) for p, o in zip(prompts, outputs)]
  decode_checks = 0
  for chunks, cu_q_lens, topk in steps:
    assert topk is not None and topk.shape[0] == model.config.num_hidden_layers
    for i, (request_id, start, n) in enumerate(chunks):
      ref = refs[int(request_id)]
      for j in range(n):
        token, position = cu_q_lens[i] + j, start + j
        ours = [_causal_set(topk[layer, token], position) for layer in indexer_layers]
        assert ours == [_causal_set(r[position], position) for r in ref], (request_id, position)
        for layer, t in enumerate(model.config.indexer_types):  # shared: the previous's
          if t == "shared":
            np.testing.assert_array_equal(topk[layer, token], topk[layer - 1, token])
        assert len(ours[0]) == min(position + 1, 8)  # sparsity active past index_topk
        decode_checks += n == 1
  assert decode_checks >= len(prompts) * (NUM_GREEDY - 1)


def test_default_hisparse_follows_the_model_index_topk(checkpoint):
  # HiSparseConfig() on a DSA model: its learned indexer and index_topk (8), a hot buffer
  # of 2 x 8 token slots (not the block top-k default's 4,096), and the capacity line says
  # so; requests past the hot buffer decode sparse.
  _, _, _, model, _, _ = checkpoint
  engine = _engine(model, hisparse=HiSparseConfig())
  hs = engine.config.hisparse
  assert (hs.indexer, hs.top_k_tokens, hs.hot_buffer_tokens, hs.sparse_threshold_tokens) == (
      "lightning", 8, 16, 16)
  lines = engine.capacity.log_lines(MAX_MODEL_LEN)
  assert ("HiSparse (learned indexer, top-k 8 tokens)" in lines[0]
          and "hot buffer 4 blocks = 16 token slots per offloaded request" in lines[0])
  assert "HiSparse runs" in lines[-1] and "decode dense" not in lines[-1]


def test_offloaded_decoding_gives_the_all_resident_tokens(checkpoint):
  # One HiSparse config on a device pool that holds about two of the four requests: each
  # request alone first (nothing offloaded), then all four at once (long decoders are
  # offloaded, keep their caches on the host and load their selected tokens back).
  kind, _, _, model, prompts, greedy = checkpoint
  engine = _engine(model, device_kv_gib=0.00026, hisparse=LIGHTNING)
  assert engine.config.hisparse.top_k_tokens == model.config.index_topk == 8
  resident = run_alone(engine, prompts, GREEDY)
  m = engine.metrics()
  assert m["hisparse_offloads_total"] == 0 and m["hisparse_hot_buffer_loads_total"] == 0
  assert engine.block_manager.device_pool.num_free_blocks == engine.device_pool.num_usable_blocks
  offloaded = _run(engine, prompts)
  m = engine.metrics()
  assert m["hisparse_offloads_total"] > 0 and m["hisparse_hot_buffer_loads_total"] > 0
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0
  assert m['hisparse_blocks_selected_total{source="hot"}'] > 0
  assert engine.block_manager.device_pool.num_free_blocks == engine.device_pool.num_usable_blocks
  assert offloaded == resident == greedy


def test_capacity_lines_list_both_caches_and_equal_the_live_bytes(checkpoint, caplog):
  model = checkpoint[3]
  with caplog.at_level("INFO"):
    engine = _engine(model, device_kv_gib=0.0008, hisparse=LIGHTNING)
  spec = engine.device_pool.spec
  lines = [r.getMessage() for r in caplog.records if "KV cache capacity" in r.getMessage()]
  assert len(lines) == 3, lines
  for pool, line in zip((engine.device_pool, engine.host_pool), lines):
    latent = sum(int(a.nbytes) for a in pool.latent)
    index = sum(int(a.nbytes) for a in pool.index_k)
    assert len(pool.latent) == spec.num_layers and len(pool.index_k) == len(spec.index_layers)
    assert latent + index == pool.nbytes
    tier = engine.capacity[pool.memory_kind]
    assert tier.caches == (("MLA latent", spec.latent_bytes_per_token, latent),
                           ("indexer keys", spec.index_bytes_per_token, index))
    assert f"memory_kind={pool.memory_kind}" in line
    assert f"MLA latent {spec.latent_bytes_per_token:,} bytes per token" in line
    assert f"indexer keys {spec.index_bytes_per_token:,} bytes per token" in line
    assert tier.kv_bytes == pool.nbytes
  # float32, 48-wide latents in every layer, 32-wide keys in the indexer layers
  assert spec.latent_bytes_per_token == model.config.num_hidden_layers * 48 * 4
  assert spec.index_bytes_per_token == len(spec.index_layers) * 32 * 4
  # The device's reserved bytes: the indexer keys of every host block, and the state.
  runner = engine.runner
  host_index = sum(int(a.nbytes) for a in runner.bounds)
  assert host_index == engine.host_pool.num_blocks * BLOCK_SIZE * spec.index_bytes_per_token
  assert engine.capacity[DEVICE].reserved_bytes == runner.reserved_bytes
  assert f"indexer keys of host blocks {host_index:,} bytes" in lines[0]
  assert "top-k 8 tokens" in lines[0]
  assert PINNED_HOST in lines[1]


def test_bad_input_names_the_field(checkpoint, tmp_path):
  kind, path, _, model, _, _ = checkpoint
  one_line = functools.partial(pytest.raises, ValueError)
  with one_line(match=r"index_topk=8 \(the model's config.json\) is not below max_model_len=8"):
    _engine(model, max_model_len=8, hisparse=LIGHTNING)
  with one_line(match=r"--hot_buffer_tokens \(4\) must be >= the model's index_topk \(8\)"):
    _engine(model, hisparse=HiSparseConfig(indexer="lightning", hot_buffer_tokens=4))
  # (the block indexer asked for by name; left to its default it is the learned one)
  with one_line(match="selects with its learned indexer; use indexer='lightning'"):
    _engine(model, hisparse=HiSparseConfig(top_k_tokens=16, indexer="block_bounds"))
  with one_line(match=r"--kv_cache_dtype=int8: 8-bit caches of DSA models"):
    _engine(model, kv_cache_dtype="int8")
  with one_line(match=r"--tensor_parallel_size=2: DSA models"):
    _engine(model, tensor_parallel_size=2)
  # A checkpoint without one of its indexer's tensors.
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text((path / "config.json").read_text())
  tensors = load_file(path / "model.safetensors")
  name = "model.layers.0.self_attn.indexer.wk.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors")
  with pytest.raises(CheckpointError, match=f"missing tensor '{re.escape(name)}'"):
    Engine(EngineConfig(model=str(broken), max_model_len=MAX_MODEL_LEN))
  raw = json.loads((path / "config.json").read_text())
  assert raw["model_type"] == kind


def test_a_llama_model_refuses_the_learned_indexer():
  from models.llama import LlamaForCausalLM  # noqa: PLC0415
  model = LlamaForCausalLM(testing.tiny_random_config(), seed=0)
  with pytest.raises(ValueError, match="indexer='lightning' needs a model with a learned"):
    _engine(model, hisparse=LIGHTNING)


def test_the_dsa_step_lowers_for_cuda_with_in_step_token_loads(checkpoint):
  # The batches a CPU engine ran (an offloaded decode step among them), lowered for a GPU
  # from this host: the Triton sparse MLA kernel, the host pool's latent pages of every
  # layer in pinned_host, the missed tokens gathered by a host computation.
  import copy  # noqa: PLC0415
  model = checkpoint[3]
  engine = _engine(model, device_kv_gib=0.00026, hisparse=LIGHTNING)
  batches, dispatch = [], engine.runner.dispatch

  def recording(batch, prev_tokens=None):
    batches.append(copy.deepcopy(batch))
    return dispatch(batch, prev_tokens)

  engine.runner.dispatch = recording
  _run(engine, checkpoint[4])
  tiered = next(b for b in batches if b.metadata.num_sparse_rows)
  for batch in (batches[0], tiered):
    text = engine.runner.lower(batch, platform="cuda").as_text()
    calls = set(re.findall(r"custom_call @([\w$.]+)\(", text)) - {"annotate_device_placement"}
    assert calls == {"__gpu$xla.gpu.triton"}, calls
    # (index_scores: the lightning indexer reads the paged keys in place)
    assert sorted(set(re.findall(r'\bname = "(\w+)"', text))) == [
        "index_scores", "sparse_mla_decode"]
  kinds = re.findall(r'mhlo.memory_kind = "(\w+)"', text)
  assert kinds.count("pinned_host") == model.config.num_hidden_layers
  assert '_xla_compute_type = "host"' in text


def test_the_pallas_kernels_give_the_xla_tokens(checkpoint):
  # The engine on the Pallas kernels (interpret mode here: the sparse MLA kernel body a GPU
  # compiles), offloaded rows included, gives the tokens of the CPU path (and of HF).
  _, _, _, model, prompts, greedy = checkpoint
  engine = _engine(model, device_kv_gib=0.00026, hisparse=LIGHTNING, kernel_backend="pallas")
  assert engine.runner.ops.backend == "pallas"
  # All four prompts: GLM's smaller latent fits three requests' blocks in this device pool.
  assert _run(engine, prompts) == greedy
  assert engine.metrics()["hisparse_offloads_total"] > 0
  assert engine.metrics()["hisparse_hot_buffer_loads_total"] > 0
