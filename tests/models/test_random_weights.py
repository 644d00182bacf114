"""models/random_weights.py: a scaled-down Llama-3.1-8B drawn on the device has every
parameter of the numpy-initialised model, in its shape and dtype, with the model's init
statistics, and runs; the full config is the 8B's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.checkpoint import get_variable, hf_param_map
from models.llama import LlamaForCausalLM
from models.random_weights import LLAMA_31_8B, llama_8b_config, random_llama

SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512)


def test_the_full_config_is_llama_31_8b():
  config = llama_8b_config()
  assert config.num_params() == pytest.approx(8.03e9, rel=0.01)
  assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
          config.head_dim, config.vocab_size) == (32, 32, 8, 128, 128256)
  assert config.rope_scaling["rope_type"] == "llama3"
  assert llama_8b_config(num_hidden_layers=4).num_hidden_layers == 4
  assert LLAMA_31_8B["intermediate_size"] == 14336


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_scaled_down_model_has_every_parameter_shape_and_dtype(dtype):
  config = llama_8b_config(**SMALL)
  model = random_llama(config, dtype, seed=3)
  reference = LlamaForCausalLM(config, dtype=dtype, seed=0)
  state = nnx.state(model, nnx.Param)
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(nnx.state(reference, nnx.Param)))
  for name, (path, _) in hf_param_map(config).items():
    got, want = get_variable(model, path)[...], get_variable(reference, path)[...]
    assert isinstance(got, jax.Array), name
    assert got.shape == want.shape and got.dtype == want.dtype == dtype, name
    assert got.devices() == {jax.devices()[0]}, name
  values = np.asarray(model.layers[0].mlp.gate_proj.kernel[...], np.float32)
  assert values.std() == pytest.approx(0.02, rel=0.05) and abs(values.mean()) < 1e-3
  down = np.asarray(model.layers[1].mlp.down_proj.kernel[...], np.float32)
  assert down.std() == pytest.approx(0.02 / 2, rel=0.05)  # 0.02 / sqrt(2 x 2 layers)
  assert np.all(np.asarray(model.norm.weight[...], np.float32) == 1.0)
  # Layers draw different values; another seed draws another model.
  q0, q1 = (np.asarray(model.layers[i].self_attn.q_proj.kernel[...], np.float32)
            for i in range(2))
  assert not np.array_equal(q0, q1)
  other = random_llama(config, dtype, seed=4)
  assert not np.array_equal(q0, np.asarray(other.layers[0].self_attn.q_proj.kernel[...],
                                           np.float32))
  ids = jnp.asarray([[1, 2, 3, 4]])
  logits, _ = model(ids, jnp.arange(4)[None])
  assert logits.shape == (1, 4, SMALL["vocab_size"]) and bool(jnp.isfinite(logits).all())
