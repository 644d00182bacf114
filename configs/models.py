"""Named model presets: a name -> checkpoint directory and its serving defaults. Data only."""

from __future__ import annotations

import dataclasses
import os

import models


@dataclasses.dataclass(frozen=True)
class ModelPreset:
  """A named checkpoint. `path` is an HF-layout directory; `max_context_len` is the longest
  context the model was trained on (it may run longer, with no quality promise)."""

  name: str
  path: str
  dtype: str = "float32"
  max_context_len: int = 1024
  description: str = ""


MODEL_PRESETS: dict[str, ModelPreset] = {
    "hisparse-tiny": ModelPreset(
        name="hisparse-tiny", path=models.DEFAULT_MODEL_DIR, dtype="float32",
        max_context_len=1024,
        description="Embedded default: 2-layer Llama (GQA 4q/2kv, head_dim 32), trained by "
                    "`python -m models.train_default` on key-value retrieval and copying."),
}
DEFAULT_MODEL = "hisparse-tiny"


def get_model_preset(name: str) -> ModelPreset:
  """The preset called `name`; KeyError listing the known names otherwise."""
  try:
    return MODEL_PRESETS[name]
  except KeyError:
    raise KeyError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None


def resolve_model_path(name_or_path: str | None) -> str:
  """A preset name or a checkpoint directory -> a directory (None = the default preset)."""
  if name_or_path is None:
    return MODEL_PRESETS[DEFAULT_MODEL].path
  if name_or_path in MODEL_PRESETS:
    return MODEL_PRESETS[name_or_path].path
  if os.path.isdir(name_or_path):
    return name_or_path
  raise KeyError(f"{name_or_path!r} is neither a model preset ({sorted(MODEL_PRESETS)}) nor "
                 "a directory")
