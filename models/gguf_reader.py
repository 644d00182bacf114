"""A GGUF file's reader and its metadata values, shared by the GGUF checkpoint
(models/gguf_checkpoint.py) and the GGUF tokenizer (models/gguf_tokenizer.py) so that
neither imports the other for them.

`open_reader` keeps one `gguf.GGUFReader` per file per process (llama.cpp's `gguf` package,
imported on use); every file that is not a readable, unsplit GGUF and every unreadable
metadata value is a `CheckpointError` naming the file and the key.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from models.checkpoint import CheckpointError

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def open_reader(path: str):
  """A `gguf.GGUFReader` over `path`; CheckpointError when the file is not a readable GGUF.

  One reader per file per process (cached by path, mtime and size): parsing the metadata
  takes seconds for a large vocabulary (7 s for SmolLM2's 49k tokens and merges on the
  2-core machine), and a run reads the config, the weights and the tokenizer."""
  if not os.path.isfile(path):
    raise CheckpointError(f"GGUF file {path} does not exist")
  st = os.stat(path)
  return _open_file(os.path.realpath(path), st.st_mtime_ns, st.st_size, path)


@functools.lru_cache(maxsize=2)
def _open_file(realpath: str, mtime_ns: int, size: int, path: str):
  import gguf  # noqa: PLC0415 (GGUF support is loaded on use)

  del realpath, mtime_ns, size  # the cache key
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise CheckpointError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, IndexError, struct errors ...
    raise CheckpointError(f"{path} is a truncated or corrupt GGUF file: "
                          f"{type(e).__name__}: {e}") from e
  split = metadata_value(reader, path, "split.count", 1)
  if isinstance(split, int) and split > 1:
    raise CheckpointError(f"{path} is one of {split} GGUF split files; split checkpoints are "
                          "not supported (merge them with llama.cpp's gguf-split --merge)")
  return reader


MISSING = object()  # metadata_value's default: a missing key is a CheckpointError


def metadata_value(reader, path: str, key: str, default: Any = MISSING) -> Any:
  """A metadata value (str, int, float, bool or list); `default` when absent."""
  field = reader.fields.get(key)
  if field is None:
    if default is MISSING:
      raise CheckpointError(f"{path} lacks metadata key {key!r}")
    return default
  try:
    return field.contents()
  except Exception as e:
    raise CheckpointError(f"{path}: metadata key {key!r} cannot be read: {e}") from e
