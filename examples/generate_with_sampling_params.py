"""Generation with per-call sampling parameters, the shape of vLLM's offline examples
that set `SamplingParams` fields (greedy, stop strings, max_tokens) and read each
`RequestOutput`: only the import line differs, and the model argument is left out.

    .venv/bin/python examples/generate_with_sampling_params.py
"""

from hisparse_jax import LLM, SamplingParams


def main():
  llm = LLM(device_kv_gib=0.01, host_pool_gib=0.01, max_model_len=256)
  greedy = SamplingParams(temperature=0.0, max_tokens=8)
  # Stop at the first ":" (a key of the model's format); the text excludes it.
  first_word = SamplingParams(temperature=0.0, max_tokens=8, stop=[":"])
  prompts = [{"prompt": "bafu: bapo\nbaki: bare\n? baki:"},
             {"prompt_token_ids": llm.get_tokenizer().encode("lefa: fabi\ntufe: sura\n? tufe:")}]
  for params in (greedy, first_word):
    for output in llm.generate(prompts, params):
      completion = output.outputs[0]
      print(f"{output.prompt_token_ids[-3:]} -> {completion.text!r} "
            f"(finish_reason={completion.finish_reason}, stop_reason={completion.stop_reason!r},"
            f" {len(completion.token_ids)} tokens, "
            f"time to first token {output.metrics.time_to_first_token_s:.3f} s)")


if __name__ == "__main__":
  main()
