"""DeepSeek-V3.2 and GLM-MoE-DSA (models/deepseek_v32.py) against transformers' eager
DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM: tiny random checkpoints (a dense layer, then
MoE layers; index_topk 8, shorter than every prompt, so the indexer's sparsity is active;
GLM: layers 1 and 3 share the previous layer's selection) saved by transformers and loaded
by ours.

Each prompt runs alone on the HF side (no padding: HF's indexer would score padded keys
with positions that ignore the padding); ours runs the prompts as one right-padded batch
(causal: a prompt's positions never see the padding after it).

16 index heads, not 4: a key whose q.k is negative in every head scores exactly 0 (ReLU),
and with 4 heads such zeros are common enough to tie at the top-k boundary, where torch's
and XLA's top-k break ties differently (both are right; the selected sets and then the
logits differ). With 16 heads an all-negative key is a 1 in 65,536 event."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm

from models import deepseek_v32 as ds
from models import deepseek_v32_checkpoint, testing
from models.config import ConfigError
from models.loader import CheckpointError

HF_CONFIG = testing.DSA_TINY_HF_CONFIG
# kind -> (config overrides, transformers classes, indexer class).
CASES = {
    "deepseek_v32": (testing.DSA_KIND_OVERRIDES["deepseek_v32"],
                     (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
                     hf_ds.DeepseekV32Indexer),
    "glm_moe_dsa": (testing.DSA_KIND_OVERRIDES["glm_moe_dsa"],
                    (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
                    hf_glm.GlmMoeDsaIndexer),
}
PROMPT_LENS = (20, 13, 27)
NUM_GREEDY = 32
BUFFER = 64  # >= max(PROMPT_LENS) + NUM_GREEDY: one compiled shape for every call


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
  """torch on one thread: its tiny ops here are ~30x faster than with OpenMP's two threads
  spinning on a shared 2-core machine (an HF eager forward: 4 ms instead of 130 ms)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


@jax.jit
def _forward(model, ids):
  return model(ids, return_topk=True)


def _save_random(path, kind, **overrides):
  """(HF eager model, our model loaded from `path`): models.testing.save_random_dsa."""
  hf = testing.save_random_dsa(path, kind, **overrides)
  return hf, deepseek_v32_checkpoint.load_pretrained(path)[0]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
  """(path, HF eager model, our model, kind)."""
  kind = request.param
  overrides = CASES[kind][0]
  path = tmp_path_factory.mktemp(kind) / "ckpt"
  hf, model = _save_random(path, kind)
  cfg, config = model.config, hf.config
  assert cfg.model_type == kind
  assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * (config.num_hidden_layers - 1)
  assert cfg.indexer_types == tuple(overrides.get("indexer_types", ["full"] * 3))
  return path, hf, model, kind


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(1)
  return [rng.integers(2, HF_CONFIG["vocab_size"], size=n) for n in PROMPT_LENS]


def _hf_run(hf, kind, ids):
  """(logits [seq, vocab], per-indexer top-k [seq, k]) of one prompt, HF eager."""
  indexer_cls = CASES[kind][2]
  caught = []
  forward = indexer_cls.forward

  def hooked(self, *args, **kwargs):
    out = forward(self, *args, **kwargs)
    caught.append(out[0].numpy())
    return out

  indexer_cls.forward = hooked
  try:
    with torch.no_grad():
      logits = hf(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].numpy()
  finally:
    indexer_cls.forward = forward
  return logits, caught


def _buffer(prompts):
  buf = np.zeros((len(prompts), BUFFER), np.int32)
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  return buf


def _causal_sets(topk, seq):
  """Per query s, the selected keys t <= s (past those, a top-k list holds masked keys in
  an arbitrary order, in HF and here alike)."""
  return [sorted(int(t) for t in topk[s] if 0 <= t <= s) for s in range(seq)]


def test_logits_and_indexer_selection_match_transformers(checkpoint, prompts):
  _, hf, model, kind = checkpoint
  logits, topks = _forward(model, jnp.asarray(_buffer(prompts)))
  logits = np.asarray(logits)
  assert logits.dtype == np.float32 and logits.shape == (len(prompts), BUFFER, 97)
  full = [i for i, t in enumerate(model.config.indexer_types) if t == "full"]
  for i, t in enumerate(model.config.indexer_types):  # a shared layer: its predecessor's
    if t == "shared":
      np.testing.assert_array_equal(np.asarray(topks[i]), np.asarray(topks[i - 1]))
  for b, ids in enumerate(prompts):
    n = len(ids)
    ref_logits, ref_topks = _hf_run(hf, kind, ids)
    np.testing.assert_allclose(logits[b, :n], ref_logits, atol=1e-4, rtol=0)
    assert len(ref_topks) == len(full)
    for layer, ref in zip(full, ref_topks):
      ours = np.asarray(topks[layer])[b]
      assert ours.shape == (BUFFER, HF_CONFIG["index_topk"]) and ref.shape == (n, 8)
      assert _causal_sets(ours, n) == _causal_sets(ref, n), (b, layer)
      # Sparsity is active: past index_topk keys, exactly index_topk are attended.
      assert all(len(s) == 8 for s in _causal_sets(ours, n)[8:])


def test_sparse_selection_changes_logits(checkpoint, prompts):
  """The top-k mask matters: a model that selects every key (index_topk = BUFFER) agrees up
  to position index_topk - 1 and differs past it."""
  model = checkpoint[2]
  dense_cfg = dataclasses.replace(model.config, index_topk=BUFFER)
  dense = nnx.merge(*nnx.split(model))
  dense.config = dense_cfg
  ids = jnp.asarray(_buffer(prompts))
  sparse_logits = np.asarray(_forward(model, ids)[0])
  dense_logits = np.asarray(_forward(dense, ids)[0])
  np.testing.assert_allclose(sparse_logits[:, :8], dense_logits[:, :8], atol=1e-5)
  assert np.abs(sparse_logits[0, 8:20] - dense_logits[0, 8:20]).max() > 1e-2


def test_greedy_matches_transformers_generate(checkpoint, prompts):
  """32 greedy tokens by full recomputation (ours) == HF generate (its DSA KV cache);
  HF's own full recomputation agrees with its cached decode."""
  _, hf, model, kind = checkpoint
  buf = _buffer(prompts)
  lens = np.asarray([len(p) for p in prompts])
  rows = np.arange(len(prompts))
  for i in range(NUM_GREEDY):
    logits = np.asarray(_forward(model, jnp.asarray(buf))[0])
    buf[rows, lens + i] = logits[rows, lens + i - 1].argmax(-1)
  for b, ids in enumerate(prompts):
    ours = buf[b, len(ids):len(ids) + NUM_GREEDY]
    with torch.no_grad():
      cached = hf.generate(torch.as_tensor(ids[None], dtype=torch.long), do_sample=False,
                           max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY,
                           pad_token_id=0, eos_token_id=None)[0, len(ids):].numpy()
      seq = torch.as_tensor(ids[None], dtype=torch.long)
      for _ in range(NUM_GREEDY):
        nxt = hf(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
      np.testing.assert_array_equal(seq[0, len(ids):].numpy(), cached)
    np.testing.assert_array_equal(ours, cached)


def test_config_and_checkpoint_errors(checkpoint, tmp_path):
  path = checkpoint[0]
  raw = json.loads((path / "config.json").read_text())
  base = ds.DeepseekV32Config.from_hf_dict(raw)
  assert base.qk_head_dim == 32 and base.softmax_scale == 32 ** -0.5
  bad = {
      "rope_parameters.rope_type='longrope'": {"rope_parameters": {
          "rope_type": "longrope", "rope_theta": 10000.0, "factor": 40.0}},
      "rope_scaling.factor is missing": {"rope_parameters": None, "rope_scaling": {
          "type": "yarn", "original_max_position_embeddings": 4096}},
      "num_key_value_heads=2": {"num_key_value_heads": 2},
      "n_routed_experts=8 is not a multiple of n_group=3": {"n_group": 3},
      "topk_group=5 exceeds": {"topk_group": 5},
      "kv_lora_rank must be a positive int": {"kv_lora_rank": 0},
      "mlp_layer_types must hold": {"mlp_layer_types": ["dense", "moe", "sparse"]},
      "model_type must be": {"model_type": "llama"},
  }
  for message, change in bad.items():
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
      ds.DeepseekV32Config.from_hf_dict({**raw, **change})
  if base.model_type == ds.GLM_MODEL_TYPE:
    bad["indexer_types must hold .* the first 'full'"] = {
        "indexer_types": ["shared", "full", "full", "full"]}
  else:
    bad["indexer_types with 'shared' layers is glm_moe_dsa only"] = {
        "indexer_types": ["full", "shared", "full"]}
  released = {k: v for k, v in raw.items() if k != "rope_parameters"}  # V3.2's rope config
  released.update(
      rope_theta=10000, qk_nope_head_dim=128, qk_rope_head_dim=64, index_head_dim=128,
      rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                    "type": "yarn"})
  cfg = ds.DeepseekV32Config.from_hf_dict(released)
  assert cfg.rope_yarn == ds.YarnRope(factor=40.0, original_max_position_embeddings=4096,
                                      mscale=1.0, mscale_all_dim=1.0)
  assert cfg.rope_yarn.cos_sin_scale == 1.0
  assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
  legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "mlp_layer_types")}
  legacy.update(rope_theta=50000.0, rope_scaling=None, first_k_dense_replace=2)
  cfg = ds.DeepseekV32Config.from_hf_dict(legacy)
  assert cfg.rope_theta == 50000.0
  assert cfg.mlp_layer_types == ("dense", "dense") + ("sparse",) * (raw["num_hidden_layers"] - 2)

  if base.model_type == ds.GLM_MODEL_TYPE:  # GlmMoeDsaConfig's indexer_types schedule
    glm = {k: v for k, v in raw.items() if k != "indexer_types"}
    for extra in ({"index_topk_pattern": "FSSF"}, {"index_topk_freq": 2},
                  {"index_topk_freq": 3, "index_skip_topk_offset": 1}, {}):
      want = transformers.GlmMoeDsaConfig(**{**HF_CONFIG, "num_hidden_layers": 4},
                                          **extra).indexer_types
      assert ds.DeepseekV32Config.from_hf_dict({**glm, **extra}).indexer_types == tuple(want)

  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  tensors = load_file(path / "model.safetensors")
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "config.json").write_text(json.dumps(raw))
  name = "model.layers.2.mlp.experts.5.up_proj.weight"  # (layer 2 has an indexer in both)
  save_file({k: v for k, v in tensors.items() if k != name}, broken / "model.safetensors")
  with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
    deepseek_v32_checkpoint.load_pretrained(broken)


def test_fused_expert_layout_loads_the_same(checkpoint, prompts, tmp_path):
  """transformers' in-memory layout (experts.gate_up_proj [E, 2 * inter, hidden], gate
  first; experts.down_proj [E, hidden, inter]) loads to the same model as per-expert
  tensors (the layout save_pretrained writes, as the released checkpoints do)."""
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  path, _, model, _ = checkpoint
  tensors = load_file(path / "model.safetensors")
  for i in range(1, model.config.num_hidden_layers):
    pre = f"model.layers.{i}.mlp.experts."
    per = {p: np.stack([tensors.pop(f"{pre}{j}.{p}.weight") for j in range(8)])
           for p in ("gate_proj", "up_proj", "down_proj")}
    tensors[pre + "gate_up_proj"] = np.concatenate([per["gate_proj"], per["up_proj"]], 1)
    tensors[pre + "down_proj"] = per["down_proj"]
  fused = tmp_path / "fused"
  fused.mkdir()
  (fused / "config.json").write_text((path / "config.json").read_text())
  save_file(tensors, fused / "model.safetensors")
  loaded, _ = deepseek_v32_checkpoint.load_pretrained(fused)
  ids = jnp.asarray(_buffer(prompts))
  np.testing.assert_array_equal(np.asarray(_forward(loaded, ids)[0]),
                                np.asarray(_forward(model, ids)[0]))


def test_yarn_rope_matches_transformers(tmp_path, prompts):
  """YaRN (the released DeepSeek-V3.2's rope type): frequencies ramped between
  interpolation and extrapolation, cos/sin times mscale / mscale_all_dim's ratio, the
  softmax scale times get_mscale(factor, mscale_all_dim) ** 2."""
  rope = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "mscale": 1.0,
          "mscale_all_dim": 0.8, "original_max_position_embeddings": 8}
  hf, model = _save_random(tmp_path / "yarn", "deepseek_v32", rope_parameters=rope)
  yarn = model.config.rope_yarn
  assert yarn is not None and yarn.cos_sin_scale != 1.0
  assert model.config.softmax_scale == pytest.approx(
      32 ** -0.5 * (0.1 * 0.8 * np.log(4.0) + 1) ** 2)
  ids = prompts[2]
  logits, topks = _forward(model, jnp.asarray(_buffer([ids])))
  ref_logits, ref_topks = _hf_run(hf, "deepseek_v32", ids)
  np.testing.assert_allclose(np.asarray(logits)[0, :len(ids)], ref_logits, atol=1e-4, rtol=0)
  for ours, ref in zip(topks, ref_topks):
    assert _causal_sets(np.asarray(ours)[0], len(ids)) == _causal_sets(ref, len(ids))


@jax.jit
def _forward_masked(model, ids, positions, key_mask):
  return model(ids, positions, key_mask=key_mask, return_topk=True)


def test_left_padding_with_key_mask_matches_each_prompt_alone(checkpoint, prompts):
  """Left padding, positions counted from each prompt's first token and key_mask False on
  the padding: the logits and the selected keys are those of the prompt alone (padded keys
  never attended, never selected past index_topk real keys)."""
  model = checkpoint[2]
  longest = max(PROMPT_LENS)
  ids = np.zeros((len(prompts), longest), np.int32)
  pad = np.asarray([longest - len(p) for p in prompts])
  for b, p in enumerate(prompts):
    ids[b, pad[b]:] = p
  positions = np.maximum(np.arange(longest)[None] - pad[:, None], 0).astype(np.int32)
  key_mask = np.arange(longest)[None] >= pad[:, None]
  logits, topks = _forward_masked(model, jnp.asarray(ids), jnp.asarray(positions),
                                  jnp.asarray(key_mask))
  alone_logits, alone_topks = _forward(model, jnp.asarray(_buffer(prompts)))
  for b, p in enumerate(prompts):
    n = len(p)
    np.testing.assert_allclose(np.asarray(logits)[b, pad[b]:], np.asarray(alone_logits)[b, :n],
                               atol=1e-4, rtol=0)
    for ours, alone in zip(topks, alone_topks):
      shifted = np.asarray(ours)[b, pad[b]:] - pad[b]
      assert _causal_sets(shifted, n) == _causal_sets(np.asarray(alone)[b], n)


def test_bfloat16_keeps_router_and_indexer_weights_float32(checkpoint, prompts):
  """dtype="bfloat16": every parameter bfloat16 but the router's (weight and
  e_score_correction_bias) and indexer.weights_proj, float32 as HF keeps them; logits are
  float32 and follow the float32 model's loosely: at this init (0.3) bfloat16 flips some
  expert and top-k choices, and transformers' own bfloat16 model is 10-22% (mean absolute
  logit error over mean absolute logit) from its float32 one here."""
  path, _, model, _ = checkpoint
  bf16, _ = deepseek_v32_checkpoint.load_pretrained(path, dtype="bfloat16")
  layer = bf16.layers[2]  # MoE, with an indexer in both kinds
  assert layer.mlp.gate.weight[...].dtype == jnp.float32
  assert layer.mlp.gate.e_score_correction_bias[...].dtype == jnp.float32
  assert layer.self_attn.indexer.weights_proj.kernel[...].dtype == jnp.float32
  assert layer.self_attn.kv_b_proj.kernel[...].dtype == jnp.bfloat16
  assert layer.mlp.experts.down_proj[...].dtype == jnp.bfloat16
  ids = jnp.asarray(_buffer(prompts))
  ours = np.asarray(_forward(bf16, ids)[0])
  ref = np.asarray(_forward(model, ids)[0])
  assert ours.dtype == np.float32
  err = np.abs(ours[:, :13] - ref[:, :13]).mean() / np.abs(ref[:, :13]).mean()
  assert err < 0.3, err
