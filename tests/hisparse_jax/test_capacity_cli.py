"""`hisparse-jax capacity` end to end, in a subprocess (absl logs go to stderr)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import tokenizers

import models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"KV cache capacity \[(memory_kind=device|memory_kind=pinned_host|total)\]: "
                  r"[^\n]*")


def _run(*flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", "capacity", *flags], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


def _capacity_lines(stderr: str) -> list[str]:
  return [m.group(0) for m in LINE.finditer(stderr)]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  """A 2-layer Llama checkpoint in HF layout (zero weights): 2 KV heads x 8 dims, so 256
  KV bytes per float32 token. Written with numpy: building a model would cost seconds."""
  path = tmp_path_factory.mktemp("tiny")
  vocab, hidden, inter, heads, kv_heads, head_dim, layers = 8, 32, 64, 4, 2, 8, 2
  config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab,
                hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
  (path / "config.json").write_text(json.dumps(config))
  shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
            "lm_head.weight": (vocab, hidden)}
  for i in range(layers):
    prefix = f"model.layers.{i}."
    shapes.update({
        prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": (inter, hidden),
        prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
        prefix + "input_layernorm.weight": (hidden,),
        prefix + "post_attention_layernorm.weight": (hidden,),
    })
  safetensors.numpy.save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()},
                              str(path / "model.safetensors"))
  tokenizer = tokenizers.Tokenizer(
      tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
  tokenizer.save(str(path / "tokenizer.json"))
  return str(path)


def test_capacity_lines_of_a_checkpoint(tiny_checkpoint):
  # 4 MiB / 4,096 bytes per block = 1,024 device blocks (1,023 usable); 16 MiB = 4,096 host
  # blocks (4,095 usable); 1,024 tokens per request = 64 blocks.
  result = _run(f"--model={tiny_checkpoint}", "--device_kv_gib=0.00390625",
                "--host_pool_gib=0.015625", "--max_model_len=1024", "--block_size=16")
  assert result.returncode == 0, result.stderr
  lines = [line.split("; ")[0] if "[total]" not in line else line
           for line in _capacity_lines(result.stderr)]
  assert lines == [
      "KV cache capacity [memory_kind=device]: 0.00 GiB = 1,023 blocks x 16 tokens = "
      "16,368 tokens",
      "KV cache capacity [memory_kind=pinned_host]: 0.02 GiB = 4,095 blocks x 16 tokens = "
      "65,520 tokens",
      "KV cache capacity [total]: 81,888 tokens; max concurrency for 1,024 tokens per "
      "request: 79.97x (device only: 15.98x)",
  ]


def test_refusal_is_one_line_naming_the_flag(tiny_checkpoint, capsys):
  # In process (the subprocess tests above and below cover the process boundary).
  from absl import flags  # noqa: PLC0415

  from hisparse_jax import cli  # noqa: PLC0415

  flags.FLAGS(["hisparse-jax", f"--model={tiny_checkpoint}", "--host_pool_gib=1000000"])
  try:
    status = cli._main(["hisparse-jax", "capacity"])
  finally:
    flags.FLAGS.unparse_flags()
  assert status == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err
  assert err.startswith("hisparse-jax capacity: error: --host_pool_gib=1000000.0 asks for "
                        "1000000.00 GiB of pinned host memory, above 95% of the available RAM")


DEFAULT_CONFIG = os.path.join(models.DEFAULT_MODEL_DIR, "config.json")


@pytest.mark.skipif(not os.path.isfile(DEFAULT_CONFIG),
                    reason=f"needs the embedded default model: {DEFAULT_CONFIG} is missing "
                           "(models/hisparse_tiny not built yet)")
def test_capacity_on_the_default_model():
  result = _run()  # the default flags of hisparse_jax.cli
  assert result.returncode == 0, result.stderr
  lines = _capacity_lines(result.stderr)
  assert [line.split("]")[0] for line in lines] == [
      "KV cache capacity [memory_kind=device", "KV cache capacity [memory_kind=pinned_host",
      "KV cache capacity [total"]
  with open(DEFAULT_CONFIG) as f:
    config = json.load(f)
  head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
  bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                     * head_dim * 4)  # float32 KV by default
  assert f"; {bytes_per_token:,} bytes per token" in lines[0]
  assert "max concurrency for 2,048 tokens per request" in lines[2]
