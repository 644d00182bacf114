"""`hisparse-jax convert`: any checkpoint this project loads -> a Hugging Face-layout directory.

Usage::

  hisparse-jax convert --model=FILE.gguf|DIR|PRESET --out=DIR [--dtype=auto|float32|bfloat16]

Writes into --out (a new directory, or an empty one): config.json (llama / qwen2 / mistral,
as transformers and vLLM read it, with torch_dtype), model.safetensors (the weights as this
project loads them: GGUF tensors dequantized, in --dtype; auto = the checkpoint's own,
float32 for a quantized GGUF), tokenizer.json + tokenizer_config.json (BOS/EOS/pad tokens,
chat template) and generation_config.json (EOS ids, end-of-turn tokens included). The
directory loads back here with the same logits, and in transformers
(`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer`) and vLLM. The writing is
`models.loader.convert` (files written beside --out, renamed to it when complete).

Prints one line on stdout: what was written. Bad input exits 2 with one line naming the
flag, before the model loads: no --out, --out an existing file or a non-empty directory,
--out not writable.
"""

from __future__ import annotations

import os

from absl import flags

FLAGS = flags.FLAGS


def check_out(out: str | None) -> str:
  """--out as an absolute path, or ValueError naming the flag: a new or empty directory
  whose nearest existing ancestor is a writable directory."""
  if not out:
    raise ValueError("--out is required: the directory to write the checkpoint into")
  path = os.path.abspath(out)
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise ValueError(f"--out={out}: exists and is not a directory")
    if os.listdir(path):
      raise ValueError(f"--out={out}: directory exists and is not empty (give a new or "
                       "empty directory)")
  parent = os.path.dirname(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ValueError(f"--out={out}: {parent} is not a directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"--out={out}: directory {parent} is not writable")
  return path


def main(argv: list[str]) -> int:
  del argv  # all input comes from the shared flags of hisparse_jax.entrypoints.cli.flag_defs
  out = check_out(FLAGS.out)
  from models import loader  # noqa: PLC0415 (heavy: jax)

  try:
    config, dtype = loader.convert(FLAGS.model, out, dtype=FLAGS.dtype)
  except PermissionError as e:
    raise ValueError(f"--out={FLAGS.out}: not writable: {e}") from None
  size = os.path.getsize(os.path.join(out, loader.WEIGHTS_FILE))
  print(f"wrote {out}: {config.model_type}, {config.num_hidden_layers} layers, "
        f"{config.num_params():,} parameters in {dtype} ({size / 2**20:,.1f} MiB "
        f"model.safetensors), tokenizer, generation_config", flush=True)
  return 0
