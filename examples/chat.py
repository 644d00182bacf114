"""Chat, written as vLLM's `examples/offline_inference/basic/chat.py` is: only the import
line differs, and the model argument is left out. The default model's chat template
(tokenizer_config.json) puts each message's content on its own line after <bos>: a
system message with `key: value` facts, then the user's "? key:" question.

    .venv/bin/python examples/chat.py
"""

from hisparse_jax import LLM, SamplingParams


def print_outputs(outputs):
  print("\nGenerated Outputs:\n" + "-" * 80)
  for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}\n")
    print(f"Generated text: {generated_text!r}")
    print("-" * 80)


def main():
  llm = LLM(device_kv_gib=0.01, host_pool_gib=0.01, max_model_len=256)
  sampling_params = SamplingParams(temperature=0.0, max_tokens=1)  # the answer word
  conversation = [
      {"role": "system", "content": "bafu: bapo\nbaki: bare\nmuvi: mive"},
      {"role": "user", "content": "? baki:"},
  ]
  outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
  print_outputs(outputs)

  # A batch of conversations in one call.
  conversations = [conversation, [conversation[0], {"role": "user", "content": "? muvi:"}]]
  outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
  print_outputs(outputs)

  # A chat template of one's own (here: the messages in reverse order, so a question
  # sent first still comes after the facts).
  chat_template = ("{{ bos_token }}{% for m in messages | reverse %}{{ m['content'] }}"
                   "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}")
  swapped = [{"role": "user", "content": "? bafu:"}, conversation[0]]
  outputs = llm.chat(swapped, sampling_params, use_tqdm=False, chat_template=chat_template)
  print_outputs(outputs)


if __name__ == "__main__":
  main()
