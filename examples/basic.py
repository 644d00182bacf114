"""Offline batch generation, written as vLLM's `examples/offline_inference/basic/basic.py`
is: only the import line differs, and the model argument is left out (the embedded
default model, hisparse-tiny, answers key-value retrieval prompts).

    .venv/bin/python examples/basic.py
"""

from hisparse_jax import LLM, SamplingParams

# Prompts for the default model: "key: value" lines, then "? key:" asks for a value.
prompts = [
    "bafu: bapo\nbaki: bare\n? baki:",
    "muvi: mive\nrora: vema\nvolo: maga\n? rora:",
    "lefa: fabi\ntufe: sura\n? tufe:",
    "bafu: bapo\nbaki: bare\n? bafu:",
]
# Nucleus sampling, as the vLLM example sets it.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)


def main():
  llm = LLM(device_kv_gib=0.01, host_pool_gib=0.01, max_model_len=256)
  outputs = llm.generate(prompts, sampling_params)
  print("\nGenerated Outputs:\n" + "-" * 60)
  for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt:    {prompt!r}")
    print(f"Output:    {generated_text!r}")
    print("-" * 60)


if __name__ == "__main__":
  main()
