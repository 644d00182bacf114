"""Every way a checkpoint directory can be broken gives a CheckpointError naming the file
(and the tensor), never a silent load or a raw library exception."""

import json
import os
import shutil

import numpy as np
import pytest
from models_testlib import save_tiny_hf
from safetensors.numpy import load_file, save_file

from models.loader import CheckpointError, load_config, load_pretrained

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
  return save_tiny_hf(tmp_path_factory.mktemp("good") / "ckpt", "llama")


@pytest.fixture
def ckpt(good_dir, tmp_path):
  path = tmp_path / "ckpt"
  shutil.copytree(good_dir, path)
  return path


def _edit_tensors(path, edit):
  tensors = load_file(str(path / WEIGHTS))
  edit(tensors)
  save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})


def _edit_config(path, edit):
  raw = json.loads((path / "config.json").read_text())
  edit(raw)
  (path / "config.json").write_text(json.dumps(raw))


def _error(path) -> str:
  with pytest.raises(CheckpointError) as info:
    load_pretrained(path)
  assert isinstance(info.value, ValueError)
  return str(info.value)


def test_good_checkpoint_loads(ckpt):
  model, config, tokenizer = load_pretrained(ckpt)
  assert config.num_hidden_layers == 2 and tokenizer.bos_token_id == 1


def test_missing_directory(tmp_path):
  msg = _error(tmp_path / "nowhere")
  assert "does not exist" in msg and "nowhere" in msg


@pytest.mark.parametrize("name", ["config.json", WEIGHTS, "tokenizer.json"])
def test_missing_file(ckpt, name):
  os.remove(ckpt / name)
  msg = _error(ckpt)
  assert "missing" in msg and name in msg


def test_missing_tensor(ckpt):
  _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  msg = _error(ckpt)
  assert "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg


def test_extra_tensor(ckpt):
  _edit_tensors(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight":
                                          np.zeros((3, 3), np.float32)}))
  msg = _error(ckpt)
  assert "model.layers.2.mlp.up_proj.weight" in msg and WEIGHTS in msg


def test_shape_mismatch(ckpt):
  def edit(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  _edit_tensors(ckpt, edit)
  msg = _error(ckpt)
  assert "model.layers.0.self_attn.k_proj.weight" in msg and WEIGHTS in msg
  assert "(16, 64)" in msg and "(32, 64)" in msg


def test_truncated_file(ckpt):
  data = (ckpt / WEIGHTS).read_bytes()
  (ckpt / WEIGHTS).write_bytes(data[: len(data) // 2])
  msg = _error(ckpt)
  assert WEIGHTS in msg and "truncated" in msg


def test_corrupt_header(ckpt):
  (ckpt / WEIGHTS).write_bytes(b"\xff" * 64)
  msg = _error(ckpt)
  assert WEIGHTS in msg and "corrupt" in msg


def test_missing_shard(ckpt):
  os.remove(ckpt / WEIGHTS)
  index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002.safetensors"}}
  (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
  msg = _error(ckpt)
  assert "model-00002.safetensors" in msg and "model.norm.weight" in msg


def test_unknown_model_type(ckpt):
  _edit_config(ckpt, lambda raw: raw.update(model_type="gpt_neox"))
  msg = _error(ckpt)
  assert "gpt_neox" in msg and "config.json" in msg


def test_unsupported_rope_type(ckpt):
  _edit_config(ckpt, lambda raw: raw.update(
      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}))
  msg = _error(ckpt)
  assert "yarn" in msg and "config.json" in msg


def test_config_missing_field(ckpt):
  _edit_config(ckpt, lambda raw: raw.pop("hidden_size"))
  with pytest.raises(CheckpointError, match="hidden_size") as info:
    load_config(ckpt)
  assert "config.json" in str(info.value)


def test_config_not_json(ckpt):
  (ckpt / "config.json").write_text("{not json")
  assert "config.json" in _error(ckpt)


def test_bad_dtype_is_refused(ckpt):
  with pytest.raises(ValueError, match="float16"):
    load_pretrained(ckpt, dtype="float16")
