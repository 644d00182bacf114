"""Retrieval accuracy of a checkpoint at several context lengths (greedy, dense attention).

    python -m models.eval_retrieval --lengths 256,512,1024 --num_queries 100 [--json_out F]

This module owns the measurement: fresh prompts from `models.data.make_retrieval_prompts`
(a seed the trainer never uses), greedy decoding with the dense reference attention, and an
exact match of the text generated before the first newline against the expected value. It
prints a table (accuracy overall and by where the answer sits in the context).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs.models import resolve_model_path
from models import data
from models.llama import LlamaForCausalLM
from models.loader import load_pretrained
from models.tokenizer import Tokenizer

EVAL_SEED = 20261129  # the trainer draws from seed 0; prompts here are fresh


@jax.jit
def _next_tokens(model: LlamaForCausalLM, ids: jax.Array, length: jax.Array) -> jax.Array:
  """Greedy token after ids[:, :length] for a buffer ids [batch, buf_len] (causal attention
  makes whatever follows `length` irrelevant, so one compiled shape serves every step)."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  hidden, _ = model.hidden_states(ids, positions)
  last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)
  return jnp.argmax(model.compute_logits(last), axis=-1).astype(jnp.int32)


def greedy_generate(model: LlamaForCausalLM, prompts: np.ndarray, max_new_tokens: int
                    ) -> np.ndarray:
  """Greedy continuation [batch, max_new_tokens] of equal-length prompts [batch, seq], by
  re-running the full dense forward per token (the reference: no KV cache involved)."""
  batch, seq = prompts.shape
  ids = jnp.zeros((batch, seq + max_new_tokens), jnp.int32).at[:, :seq].set(prompts)
  out = []
  for i in range(max_new_tokens):
    nxt = _next_tokens(model, ids, jnp.int32(seq + i))
    out.append(nxt)
    ids = ids.at[:, seq + i].set(nxt)
  return np.asarray(jnp.stack(out, axis=1))


def answer_text(tokenizer: Tokenizer, generated: Sequence[int]) -> str:
  """The generated text up to (not including) the first newline or EOS."""
  kept = []
  for t in generated:
    if int(t) in tokenizer.eos_token_ids or tokenizer.id_to_token(t) == data.NEWLINE:
      break
    kept.append(int(t))
  return tokenizer.decode(kept).strip()


def evaluate(model: LlamaForCausalLM, tokenizer: Tokenizer, lengths: Sequence[int],
             num_queries: int, seed: int = EVAL_SEED, batch_size: int = 8) -> list[dict]:
  """One result row per context length: accuracy overall and per quarter of the context."""
  rows = []
  for length in lengths:
    prompts = data.make_retrieval_prompts(num_queries, length, seed=seed + length)
    ids = np.asarray([tokenizer.encode(p.text) for p in prompts], np.int32)
    if not np.array_equal(ids, np.asarray([p.token_ids for p in prompts])):
      raise ValueError("the checkpoint's tokenizer does not match models.data's vocabulary")
    t0 = time.time()
    generated = np.concatenate([greedy_generate(model, ids[i:i + batch_size], 2)
                                for i in range(0, len(ids), batch_size)])
    # The answer is the first generated word (the value slot); the model is not trained to
    # end the line after it, so what follows is continuation, not part of the answer.
    correct = np.asarray([answer_text(tokenizer, g).split()[:1] == [p.answer]
                          for g, p in zip(generated, prompts)])
    depth = np.asarray([p.answer_line / p.num_pairs for p in prompts])
    quarters = [float(correct[(depth >= q / 4) & (depth < (q + 1) / 4)].mean())
                if np.any((depth >= q / 4) & (depth < (q + 1) / 4)) else float("nan")
                for q in range(4)]
    rows.append({"context_len": length, "prompt_tokens": int(ids.shape[1]),
                 "num_pairs": prompts[0].num_pairs, "num_queries": num_queries,
                 "num_correct": int(correct.sum()), "accuracy": float(correct.mean()),
                 "accuracy_by_depth_quarter": quarters, "seconds": time.time() - t0})
  return rows


def format_table(rows: Sequence[dict]) -> str:
  lines = ["| context | pairs | queries | exact | accuracy | by depth (1st..4th quarter) |",
           "|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    quarters = " / ".join(f"{q:.2f}" for q in r["accuracy_by_depth_quarter"])
    lines.append(f"| {r['prompt_tokens']} | {r['num_pairs']} | {r['num_queries']} | "
                 f"{r['num_correct']} | {100 * r['accuracy']:.1f}% | {quarters} |")
  return "\n".join(lines)


_MODEL: flags.FlagHolder
_LENGTHS: flags.FlagHolder
_NUM_QUERIES: flags.FlagHolder
_SEED: flags.FlagHolder
_DTYPE: flags.FlagHolder
_JSON_OUT: flags.FlagHolder


def define_flags() -> None:
  """Defines this script's absl flags (only when run as a script: importing the module
  must not clash with the flags of other entry points, e.g. hisparse_jax.entrypoints.cli.main)."""
  global _MODEL, _LENGTHS, _NUM_QUERIES, _SEED, _DTYPE, _JSON_OUT
  _MODEL = flags.DEFINE_string("model", "hisparse-tiny", "Preset name or checkpoint directory.")
  _LENGTHS = flags.DEFINE_list("lengths", ["256", "512", "1024"], "Context lengths (tokens).")
  _NUM_QUERIES = flags.DEFINE_integer("num_queries", 100, "Prompts per context length.")
  _SEED = flags.DEFINE_integer("seed", EVAL_SEED, "Prompt seed.")
  _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")
  _JSON_OUT = flags.DEFINE_string("json_out", None, "Optional JSON output file.")


def main(argv):
  del argv
  path = resolve_model_path(_MODEL.value)
  model, _, tokenizer = load_pretrained(path, dtype=_DTYPE.value)
  rows = evaluate(model, tokenizer, [int(x) for x in _LENGTHS.value], _NUM_QUERIES.value,
                  seed=_SEED.value)
  print(f"retrieval accuracy of {path} (greedy, dense attention, {_DTYPE.value})")
  print(format_table(rows))
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"model": path, "dtype": _DTYPE.value, "seed": _SEED.value, "rows": rows},
                f, indent=2)
      f.write("\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)
