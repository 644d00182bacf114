"""GGUF checkpoints: tiny random models written as llama.cpp's converter writes them load into
the same model as their HF-directory twins (logits bit-equal), every tensor type gguf
dequantizes loads, the tokenizer comes from the metadata, and every broken file gives one
CheckpointError naming the file and what is wrong."""

import os
import subprocess
import sys
import textwrap

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models import gguf_checkpoint, testing
from models.config import ModelConfig
from models.loader import (
    CheckpointError,
    checkpoint_dtype,
    load_config,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
)
from models.tokenizer import Tokenizer, save_tokenizer_files

VOCAB = 512
EPS = 2.0 ** -17  # exact in float32, so the GGUF's float32 metadata round-trips exactly
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS,
            rope_theta=10000.0, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
CASES = {
    "llama_gqa_untied": dict(model_type="llama"),
    "llama_tied_biases_mha": dict(model_type="llama", num_key_value_heads=4,
                                  tie_word_embeddings=True, attention_bias=True,
                                  mlp_bias=True, head_dim=24, rope_theta=500000.0),
    "qwen2_mqa_tied": dict(model_type="qwen2", num_key_value_heads=1,
                           tie_word_embeddings=True, attention_bias=True),
    "mistral_sliding_window": dict(model_type="mistral", sliding_window=5),
    # Llama 3.2's rope scaling, written as llama.cpp does: rope_freqs.weight
    "llama3_rope_freqs": dict(model_type="llama", head_dim=64, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}),
}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "It's 2024: 1,234.56 and 99%!",
         "  whitespace   runs\t\tand\n\nnew lines  ", "héllo wörld naïve café 日本語 🤖",
         "<|im_start|>user\nhi<|im_end|>\n", ""]


def _ids(text_ids) -> jnp.ndarray:
  return jnp.asarray([text_ids], jnp.int32)


def _logits(model, ids) -> np.ndarray:
  ids = jnp.asarray(ids, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return np.asarray(model(ids, positions)[0])


@pytest.fixture(scope="module")
def tokenizer():
  return testing.byte_level_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def llama():
  """A tiny random llama for the tests that only need some model to write."""
  return testing.random_model(ModelConfig(**{**BASE, "model_type": "llama"}), seed=0)


def _save_hf_dir(model, tok, path) -> str:
  save_pretrained(model, path)
  save_tokenizer_files(tok, path, bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>",
                       unk="<|endoftext|>", model_max_length=128,
                       chat_template=testing.CHATML_TEMPLATE)
  return str(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_equals_hf_directory(case, tokenizer, tmp_path):
  config = ModelConfig(**{**BASE, **CASES[case]})
  model = testing.random_model(config, seed=len(case))
  hf_dir = _save_hf_dir(model, tokenizer, tmp_path / "hf")
  file = testing.save_gguf(model, tmp_path / "m.gguf", tokenizer)
  assert load_config(file) == load_config(hf_dir) == config
  ours, gguf_config, gguf_tok = load_pretrained(file)
  ref, _, hf_tok = load_pretrained(hf_dir)
  assert gguf_config == config
  ids = [hf_tok.encode(t, add_special_tokens=False) for t in TEXTS]
  assert [gguf_tok.encode(t) for t in TEXTS] == ids
  assert gguf_tok.decode(ids[3]) == hf_tok.decode(ids[3]) == TEXTS[3]
  prompt = np.asarray([sum(ids, [])[:40]])
  np.testing.assert_array_equal(_logits(ours, prompt), _logits(ref, prompt))
  messages = [{"role": "user", "content": "hi"}]
  assert gguf_tok.apply_chat_template(messages) == hf_tok.apply_chat_template(messages)
  assert (gguf_tok.bos_token_id, gguf_tok.eos_token_ids, gguf_tok.pad_token_id) == (1, (2,), 0)


def test_llama_qk_permutation_is_undone(tokenizer, tmp_path, monkeypatch):
  """Without the un-permutation the llama file's logits differ: the test above exercises it."""
  config = ModelConfig(**{**BASE, "model_type": "llama"})
  model = testing.random_model(config, seed=1)
  file = testing.save_gguf(model, tmp_path / "m.gguf", tokenizer)
  ids = np.arange(3, 19)[None]
  good = _logits(load_pretrained(file)[0], ids)
  np.testing.assert_array_equal(good, _logits(model, ids))
  monkeypatch.setattr(gguf_checkpoint, "unpermute_qk", lambda w, heads: w)
  assert np.abs(_logits(load_pretrained(file)[0], ids) - good).max() > 1e-3


def test_permute_is_llama_cpp_converter_permute():
  """permute_qk is llama.cpp's convert_hf_to_gguf `permute`; unpermute_qk inverts it."""
  w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of dim 8, 3 input features
  expected = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
  np.testing.assert_array_equal(gguf_checkpoint.permute_qk(w, 2), expected)
  np.testing.assert_array_equal(gguf_checkpoint.unpermute_qk(expected, 2), w)
  # rows of head 0 interleave its two rotate-half halves: 0, 4, 1, 5, ...
  assert list(expected[:8, 0] // 3) == [0, 4, 1, 5, 2, 6, 3, 7]


# Quantized types gguf can write from float values, and those written as random blocks
# (no Python quantizer): byte offsets of their float16 scales, set to small finite values.
QUANTIZED = [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
RAW_BLOCKS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
              Q.Q6_K: (208,), Q.IQ4_NL: (0,)}
ALL_TYPES = [Q.F32, Q.F16, *QUANTIZED, *RAW_BLOCKS]


def _raw_blocks(rng, shape, qtype) -> np.ndarray:
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
  for offset in RAW_BLOCKS[qtype]:
    scale = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
    blocks[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
  return blocks.reshape(shape[0], -1)


def test_every_tensor_type_loads_as_gguf_dequantizes_it(tokenizer, tmp_path):
  # K-quants need rows of 256 values: every matrix has 256 input features.
  config = ModelConfig(**{**BASE, "model_type": "llama", "hidden_size": 256,
                          "intermediate_size": 256, "head_dim": 64})
  model = testing.random_model(config, seed=2)
  arch, meta, tensors = testing.gguf_contents(model, tokenizer)
  rng = np.random.default_rng(0)
  matrices = sorted(n for n, t in tensors.items() if t.ndim == 2)
  assert len(matrices) >= len(ALL_TYPES)
  expected = {}
  for i, name in enumerate(matrices):
    qtype = ALL_TYPES[i % len(ALL_TYPES)]
    values = tensors[name]
    if qtype == Q.F16:
      tensors[name] = values.astype(np.float16)
    elif qtype in QUANTIZED:
      tensors[name] = (gguf.quants.quantize(values, qtype), qtype)
    elif qtype in RAW_BLOCKS:
      tensors[name] = (_raw_blocks(rng, values.shape, qtype), qtype)
    raw = tensors[name][0] if isinstance(tensors[name], tuple) else tensors[name]
    deq = gguf.quants.dequantize(raw, qtype).reshape(values.shape).astype(np.float32)
    assert np.isfinite(deq).all() and (qtype != Q.F32 or np.array_equal(deq, values))
    if ".attn_q." in name or ".attn_k." in name:
      heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
      deq = gguf_checkpoint.unpermute_qk(deq, heads)
    expected[name] = deq
  file = testing.write_gguf(tmp_path / "types.gguf", arch, meta, tensors)
  reader = gguf.GGUFReader(file)
  assert {t.tensor_type for t in reader.tensors if t.name in matrices} == set(ALL_TYPES)
  loaded, _, _ = load_pretrained(file)
  assert checkpoint_dtype(file) == "float32"
  layer = loaded.layers[1]
  got = {"token_embd.weight": loaded.embed_tokens[...],
         "output.weight": loaded.lm_head.kernel[...].T}
  for i, lay in enumerate(loaded.layers):
    for short, mod in (("attn_q", lay.self_attn.q_proj), ("attn_k", lay.self_attn.k_proj),
                       ("attn_v", lay.self_attn.v_proj), ("attn_output", lay.self_attn.o_proj),
                       ("ffn_gate", lay.mlp.gate_proj), ("ffn_up", lay.mlp.up_proj),
                       ("ffn_down", lay.mlp.down_proj)):
      got[f"blk.{i}.{short}.weight"] = mod.kernel[...].T
  assert set(got) == set(expected)
  for name in matrices:
    np.testing.assert_array_equal(np.asarray(got[name]), expected[name], err_msg=name)
  assert layer.input_layernorm.weight[...].dtype == jnp.float32
  assert np.isfinite(_logits(loaded, np.arange(1, 9)[None])).all()


def test_dtypes(tokenizer, tmp_path):
  config = ModelConfig(**{**BASE, "model_type": "llama"})
  model = testing.random_model(config, seed=4)
  f32 = testing.save_gguf(model, tmp_path / "f32.gguf", tokenizer)
  f16 = testing.save_gguf(model, tmp_path / "f16.gguf", tokenizer, tensor_type=Q.F16)
  q8 = testing.save_gguf(model, tmp_path / "q8.gguf", tokenizer, tensor_type=Q.Q8_0)
  assert [checkpoint_dtype(f) for f in (f32, f16, q8)] == ["float32", "bfloat16", "float32"]
  ids = np.arange(5, 21)[None]
  ref = _logits(model, ids)
  bf16, _, _ = load_pretrained(f32, dtype="bfloat16")
  assert bf16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  np.testing.assert_allclose(_logits(bf16, ids), ref, atol=0.05)
  np.testing.assert_allclose(_logits(load_pretrained(f16)[0], ids), ref, atol=2e-3)
  np.testing.assert_allclose(_logits(load_pretrained(q8)[0], ids), ref, atol=2e-2)
  with pytest.raises(ValueError, match="float16"):
    load_pretrained(f32, dtype="float16")


def test_tensor_parallel_load_matches_one_device(tokenizer, tmp_path):
  """mesh= shards each tensor as it is read, as for safetensors: a 4-device CPU mesh at
  tp=2 (KV heads split) and tp=4 (KV heads repeated) gives the unsharded logits."""
  config = ModelConfig(**{**BASE, "model_type": "llama"})
  file = testing.save_gguf(testing.random_model(config, seed=5), tmp_path / "m.gguf",
                           tokenizer, tensor_type=Q.Q8_0)
  script = textwrap.dedent(f"""
      import jax, numpy as np, jax.numpy as jnp
      from jax.sharding import Mesh
      from models import sharding
      from models.loader import load_pretrained
      ids = jnp.arange(3, 19, dtype=jnp.int32)[None]
      pos = jnp.arange(16, dtype=jnp.int32)[None]
      ref = np.asarray(load_pretrained({file!r})[0](ids, pos)[0])
      for tp in (2, 4):
        mesh = Mesh(np.array(jax.devices()[:tp]), (sharding.TP_AXIS,))
        model, config, _ = load_pretrained({file!r}, mesh=mesh)
        kernel = model.layers[0].self_attn.k_proj.kernel[...]
        assert len(kernel.sharding.device_set) == tp, kernel.sharding
        assert config.num_key_value_heads == max(2, tp), config
        out = np.asarray(model(ids, pos)[0])
        np.testing.assert_allclose(out, ref, atol=1e-5)
      print("ok")
  """)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env, cwd=root, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_metadata(tokenizer, llama, tmp_path):
  arch, meta, tensors = testing.gguf_contents(llama, tokenizer, add_bos_token=True,
                                              eos_token="<|endoftext|>", pad_token=None)
  tokens = meta["tokenizer.ggml.tokens"]
  user_id = next(i for i, t in enumerate(tokens) if len(t) >= 4 and t.isascii() and t.isalpha())
  user = tokens[user_id]
  meta["tokenizer.ggml.token_type"][user_id] = 4  # user-defined: matched whole, not special
  file = testing.write_gguf(tmp_path / "m.gguf", arch, meta, tensors)
  tok = load_tokenizer(file)
  assert isinstance(tok, Tokenizer)
  assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
  # EOS, then the end-of-turn token its chat template writes (<|im_end|>)
  assert tok.eos_token_ids == (0, 2) and tok.pad_token_id is None
  assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)[:1] == [1]
  assert tok.decode([1, 2, 40]) == tok.decode([40])  # control tokens are skipped
  assert tok.encode(f"x{user}x", add_special_tokens=False) == [
      tok.token_to_id("x"), user_id, tok.token_to_id("x")]
  assert tok.decode([user_id]) == user


def test_pre_tokenizer_names_change_the_split(tokenizer, llama, tmp_path):
  """smollm/starcoder split digits one by one, llama-bpe groups up to three; gpt-2 keeps runs."""
  pieces = {}
  for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2"):
    file = testing.save_gguf(llama, tmp_path / f"{pre}.gguf", tokenizer, pre=pre)
    tok = load_tokenizer(file)
    pieces[pre] = tok.backend.pre_tokenizer.pre_tokenize_str("x 12345")
  assert [p for p, _ in pieces["gpt-2"]] == ["x", "Ġ12345"]
  assert [p for p, _ in pieces["smollm"]] == ["x", "Ġ", "1", "2", "3", "4", "5"]
  assert [p for p, _ in pieces["llama-bpe"]] == ["x", "Ġ", "123", "45"]
  assert [p for p, _ in pieces["qwen2"]] == ["x", "Ġ", "1", "2", "3", "4", "5"]


# ----------------------------------------------------------------------------- bad files


@pytest.fixture(scope="module")
def contents(tokenizer, llama):
  return testing.gguf_contents(llama, tokenizer)


def _write(tmp_path, contents, edit=None, arch=None) -> str:
  old_arch, meta, tensors = contents
  meta, tensors = dict(meta), dict(tensors)
  if edit is not None:
    edit(meta, tensors)
  return testing.write_gguf(tmp_path / "bad.gguf", arch or old_arch, meta, tensors)


def _error(file, load=load_pretrained) -> str:
  with pytest.raises(CheckpointError) as info:
    load(file)
  msg = str(info.value)
  assert os.fspath(file) in msg and "\n" not in msg, msg
  return msg


def test_good_file_loads(contents, tmp_path):
  model, config, tok = load_pretrained(_write(tmp_path, contents))
  assert config.num_hidden_layers == 2 and tok.bos_token_id == 1


def test_truncated_file(contents, tmp_path):
  file = _write(tmp_path, contents)
  data = open(file, "rb").read()
  for cut in (len(data) // 2, 200, 10):  # in the tensor data, the metadata, the header
    with open(file, "wb") as f:
      f.write(data[:cut])
    msg = _error(file)
    assert "truncated or corrupt" in msg
    assert "truncated or corrupt" in _error(file, load_config)


def test_corrupt_header(tmp_path):
  file = tmp_path / "bad.gguf"
  file.write_bytes(b"GGUF" + b"\xff" * 60)
  assert "truncated or corrupt" in _error(file)


def test_not_a_gguf_file(tmp_path):
  file = tmp_path / "model.gguf"
  file.write_bytes(b'{"model_type": "llama"}')
  assert "not a GGUF file" in _error(file)
  assert "does not exist" in _error(tmp_path / "absent.gguf")


def test_unsupported_tensor_type(contents, tmp_path):
  def edit(meta, tensors):
    tensors["blk.1.ffn_up.weight"] = np.zeros((96, 64), np.int32)
  msg = _error(_write(tmp_path, contents, edit))
  assert "blk.1.ffn_up.weight" in msg and "I32" in msg and "unsupported tensor type" in msg


def test_unknown_architecture(contents, tmp_path):
  def edit(meta, tensors):
    for key in [k for k in meta if k.startswith("llama.")]:
      meta["gpt_neox." + key[len("llama."):]] = meta.pop(key)
  msg = _error(_write(tmp_path, contents, edit, arch="gpt_neox"))
  assert "unknown architecture 'gpt_neox'" in msg
  assert "gpt_neox" in _error(_write(tmp_path, contents, edit, arch="gpt_neox"), load_config)


def test_missing_tokenizer(contents, tmp_path):
  def edit(meta, tensors):
    for key in [k for k in meta if k.startswith("tokenizer.ggml")]:
      del meta[key]
  file = _write(tmp_path, contents, edit)
  assert "no tokenizer" in _error(file) and "tokenizer.ggml.tokens" in _error(file)
  assert "tokenizer.ggml.tokens" in _error(file, load_tokenizer)


@pytest.mark.parametrize("key,value,match", [
    ("tokenizer.ggml.model", "llama", "SentencePiece"),
    ("tokenizer.ggml.model", "bert", "'bert' is not supported"),
    ("tokenizer.ggml.pre", "no-such-pre", "unknown pre-tokenizer 'no-such-pre'"),
    ("tokenizer.ggml.eos_token_id", 99999, "tokenizer.ggml.eos_token_id=99999"),
    ("llama.rope.scaling.type", "yarn", "unsupported rope type 'yarn'"),
    ("llama.rope.dimension_count", 8, "partial rotary"),
    ("llama.attention.head_count_kv", 3, "not a multiple"),
    ("split.count", 3, "split files"),
])
def test_bad_metadata_value(contents, tmp_path, key, value, match):
  msg = _error(_write(tmp_path, contents, lambda meta, tensors: meta.update({key: value})))
  assert match in msg


def test_missing_metadata_key(contents, tmp_path):
  msg = _error(_write(tmp_path, contents, lambda meta, tensors: meta.pop("llama.block_count")))
  assert "lacks metadata key 'llama.block_count'" in msg


def test_missing_unexpected_and_misshapen_tensors(contents, tmp_path):
  msg = _error(_write(tmp_path, contents, lambda m, t: t.pop("blk.1.ffn_down.weight")))
  assert "missing tensor 'blk.1.ffn_down.weight'" in msg
  msg = _error(_write(tmp_path, contents, lambda m, t: t.update(
      {"blk.2.ffn_down.weight": np.zeros((4, 4), np.float32)})))
  assert "unexpected tensor 'blk.2.ffn_down.weight'" in msg
  msg = _error(_write(tmp_path, contents, lambda m, t: t.update(
      {"rope_freqs.weight": np.ones(5, np.float32)})))
  assert "rope_freqs.weight" in msg and "has shape (5,), expected (8,)" in msg
  msg = _error(_write(tmp_path, contents, lambda m, t: t.update(
      {"rope_freqs.weight": np.asarray([1, 2] * 4, np.float32)})))
  assert "rope_freqs.weight" in msg and "not llama3 rope scaling" in msg
  msg = _error(_write(tmp_path, contents, lambda m, t: t.update(
      {"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)})))
  assert "blk.0.attn_k.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg


def test_llama3_rope_factors_are_the_converters_and_round_trip():
  """llama3_rope_factors is llama.cpp's converter's formula; the loader recovers the HF
  scaling from it (Llama 3.1: factor 8; 3.2: factor 32; an unusual low_freq_factor when
  the file states the original context)."""
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
  factors = gguf_checkpoint.llama3_rope_factors(500000.0, 128, scaling)
  assert factors[0] == 1.0 and factors[-1] == 8.0 and 1 < factors[30] < 8
  for theta, dim, scale in [(500000.0, 128, scaling), (500000.0, 64, {**scaling, "factor": 32.0}),
                            (10000.0, 32, {**scaling, "low_freq_factor": 2.0,
                                           "high_freq_factor": 8.0,
                                           "original_max_position_embeddings": 512})]:
    factors = gguf_checkpoint.llama3_rope_factors(theta, dim, scale)
    context = scale["original_max_position_embeddings"] if scale["low_freq_factor"] != 1 else None
    assert gguf_checkpoint._llama3_scaling(factors, theta, dim, context, "f") == scale
  assert gguf_checkpoint._llama3_scaling(np.ones(16, np.float32), 1e4, 32, None, "f") is None
  one_medium = gguf_checkpoint.llama3_rope_factors(1e4, 32, {
      **scaling, "low_freq_factor": 2.0, "original_max_position_embeddings": 256})
  with pytest.raises(CheckpointError, match="not llama3 rope scaling"):  # one point: no fit
    gguf_checkpoint._llama3_scaling(one_medium, 1e4, 32, None, "f")
