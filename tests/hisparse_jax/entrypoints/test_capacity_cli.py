"""`hisparse-jax capacity` end to end, in a subprocess: the capacity lines are its stdout."""

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

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
LINE = re.compile(r"KV cache capacity \[(memory_kind=device|memory_kind=pinned_host|total)\]: "
                  r"[^\n]*")


def _run(*flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", "capacity", *flags], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


def _capacity_lines(stdout: str) -> list[str]:
  return [m.group(0) for m in LINE.finditer(stdout)]


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


def _main_in_process(*flag_args):
  """`hisparse-jax capacity FLAGS` in this process: the exit status (the subprocess test
  below covers the process boundary and stderr)."""
  from absl import flags  # noqa: PLC0415

  from hisparse_jax.entrypoints.cli import main as cli  # noqa: PLC0415

  flags.FLAGS(["hisparse-jax", *flag_args])
  try:
    return cli._main(["hisparse-jax", "capacity"])
  finally:
    flags.FLAGS.unparse_flags()


def test_capacity_lines_of_a_checkpoint(tiny_checkpoint, capsys):
  # 4 MiB / 4,096 bytes per block = 1,024 device blocks (1,023 usable); 16 MiB = 4,096 host
  # blocks (4,095 usable); 1,024 tokens per request = 64 blocks. The lines are stdout.
  status = _main_in_process(f"--model={tiny_checkpoint}", "--device_kv_gib=0.00390625",
                            "--host_pool_gib=0.015625", "--max_model_len=1024",
                            "--block_size=16")
  assert status == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3 and all(line.startswith("KV cache capacity [") for line in lines)
  lines = [line.split("; ")[0] if "[total]" not in line else line for line in lines]
  assert lines == [
      "KV cache capacity [memory_kind=device]: 4.00 MiB = 1,023 blocks x 16 tokens = "
      "16,368 tokens",
      "KV cache capacity [memory_kind=pinned_host]: 0.02 GiB = 4,095 blocks x 16 tokens = "
      "65,520 tokens",
      "KV cache capacity [total]: 81,888 tokens; max concurrency for 1,024 tokens per "
      "request: 79.97x (device only: 15.98x)",
  ]


def test_refusal_is_one_line_naming_the_flag(tiny_checkpoint, capsys):
  assert _main_in_process(f"--model={tiny_checkpoint}", "--host_pool_gib=1000000") == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err
  assert err.startswith("hisparse-jax capacity: error: --host_pool_gib=1000000.0 asks for "
                        "1,000,000.00 GiB of pinned host memory, above 95% of the available RAM")


DEFAULT_CONFIG = os.path.join(models.DEFAULT_MODEL_DIR, "config.json")


@pytest.mark.skipif(not os.path.isfile(DEFAULT_CONFIG),
                    reason=f"needs the embedded default model: {DEFAULT_CONFIG} is missing "
                           "(models/hisparse_tiny not built yet)")
def test_capacity_on_the_default_model():
  # Default model, dtype, block size and max_model_len; small pools keep the test fast
  # (the default 1 GiB host pool takes seconds to allocate on a loaded CPU).
  result = _run("--device_kv_gib=0.0625", "--host_pool_gib=0.125")
  assert result.returncode == 0, result.stderr
  with open(DEFAULT_CONFIG) as f:
    config = json.load(f)
  head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
  bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                     * head_dim * 4)  # float32 KV by default
  bs = 128  # the default block size on CPU (engine.default_block_size)
  device_blocks = 2**26 // (bs * bytes_per_token) - 1  # 64 MiB, less the null block
  host_blocks = 2**27 // (bs * bytes_per_token) - 1  # 128 MiB
  lines = _capacity_lines(result.stdout)
  assert result.stdout.splitlines() == lines  # the command's output: these lines only
  assert len(lines) == 3
  assert lines[0].startswith(
      f"KV cache capacity [memory_kind=device]: 0.06 GiB = {device_blocks:,} blocks x {bs} "
      f"tokens = {device_blocks * bs:,} tokens; {bytes_per_token:,} bytes per token")
  assert lines[1].startswith(
      f"KV cache capacity [memory_kind=pinned_host]: 0.12 GiB = {host_blocks:,} blocks x {bs} "
      f"tokens = {host_blocks * bs:,} tokens; {bytes_per_token:,} bytes per token")
  assert lines[2] == (
      f"KV cache capacity [total]: {(device_blocks + host_blocks) * bs:,} tokens; max "
      f"concurrency for 2,048 tokens per request: "
      f"{(device_blocks + host_blocks) * bs / 2048:.2f}x "
      f"(device only: {device_blocks * bs / 2048:.2f}x)")
