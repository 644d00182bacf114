"""examples/embed_decode_loop.py (a hand-written JAX decode loop over hisparse_jax's KV
cache, kernels and attention, no Engine) gives the Engine's greedy tokens, across a
preemption by swap to the pinned_host pool, and logs the same capacity lines."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from hisparse_jax import LLM, SamplingParams
from models import data

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "embed_decode_loop.py"
BLOCK_SIZE = 16
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("embed_decode_loop", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_embedding_example_tokens_equal_the_engines(example, capsys):
  prompts = [list(p.token_ids) for p in data.make_retrieval_prompts(2, 300, seed=3)]
  prompts += [list(p.token_ids) for p in data.make_retrieval_prompts(1, 700, seed=4)]
  result = example.generate(prompts, MAX_NEW_TOKENS, block_size=BLOCK_SIZE,
                            device_kv_gib=0.01, host_pool_gib=0.01, swap_at_step=4)
  printed = capsys.readouterr().out
  # The preemption moved every block of the first prompt out and back.
  blocks = -(-(len(prompts[0]) + 4) // BLOCK_SIZE)  # its tokens after 4 decode steps
  assert result["swapped_blocks"] == {"out": blocks, "in": blocks}
  # The capacity lines of both memory kinds and the total, as the engine logs them.
  lines = [line for line in printed.splitlines() if line.startswith("KV cache capacity")]
  assert [line.split("]")[0] for line in lines] == [
      "KV cache capacity [memory_kind=device", "KV cache capacity [memory_kind=pinned_host",
      "KV cache capacity [total"]

  llm = LLM(block_size=BLOCK_SIZE, device_kv_gib=0.01, host_pool_gib=0.01,
            enable_prefix_caching=False)
  outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS,
                                        ignore_eos=True), use_tqdm=False)
  engine_tokens = [list(o.outputs[0].token_ids) for o in outputs]
  assert result["tokens"] == engine_tokens
  assert all(len(t) == MAX_NEW_TOKENS for t in result["tokens"])
  # Same pools, same lines: the engine's capacity report equals the example's.
  assert llm.engine.capacity.log_lines(2048) == lines
