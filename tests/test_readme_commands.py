"""Every `hisparse-jax` command line in README.md's code blocks runs as written: exit 0.

The lines are read from README.md (a `\\` at a line's end continues it), so a line that
stops working, or a new line that does not work, fails here. Each runs as
`python -m hisparse_jax ARGS` in the repository root, two at a time. A line whose comment
says `exit N` (a refusal the README shows) must exit N with one error line. A line that ends in
`# answers: WORDS` must print an output whose first words are WORDS, and a run with expected
answers (a prompts file) must get them all right. Exceptions, each with why:

- `SMALLER`: flags appended to a line (absl: a later flag wins) so that it runs in
  seconds; the line's own flags are still parsed and used.
- `PARSE_ONLY`: commands that cannot run here; their flags are parsed (an unknown flag or
  a bad value fails) and `--suite` must name a suite, but nothing runs.
"""

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys

import pytest
from absl import flags

from hisparse_jax.entrypoints.cli import bench as bench_cmd
from hisparse_jax.entrypoints.cli import main as cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PREFIXES = (("hisparse-jax",), (".venv/bin/hisparse-jax",), ("python", "-m", "hisparse_jax"),
            (".venv/bin/python", "-m", "hisparse_jax"))
SMALLER = {
    # 3 passkey prompts of ~4k tokens (the real model) or 8 retrieval prompts of 1,026 (the
    # toy) take minutes on 2 cores; 300 tokens is still a passkey the 135M model answers
    # (at ~100 its answer to a needle at 90% depth is "the pass key").
    "demo": ("--demo_num_prompts=2", "--demo_context_len=300"),
    # every program compiles in tests/hisparse_jax/entrypoints/test_compile_cli.py; here one
    # (and the report to nowhere, not into the checkout)
    "compile": ("--programs=decode", f"--out={os.devnull}"),
}
PARSE_ONLY = {
    "convert": "writes a new directory (the real model's: 540 MB); "
               "tests/hisparse_jax/entrypoints/test_convert_cli.py runs it",
    "serve": "serves until SIGTERM; tests/hisparse_jax/entrypoints/test_serve.py runs it",
    "bench": "the suites take minutes and engine_vs_vllm needs `make peers` (vLLM's CPU "
             "build); tests/hisparse_jax/bench/test_bench.py runs every suite at "
             "--bench_size=smoke",
}


def readme_commands() -> list[str]:
  """The CLI lines of README's ``` blocks, continuations joined, comments kept."""
  with open(README) as f:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", f.read(), flags=re.M | re.S)
  commands = []
  for block in blocks:
    for line in block.replace("\\\n", " ").splitlines():
      words = shlex.split(line, comments=True)
      if any(tuple(words[:len(p)]) == p for p in PREFIXES):
        commands.append(line.strip())
  return commands


def argv_of(line: str) -> list[str]:
  """The arguments after the program (`hisparse-jax` or `python -m hisparse_jax`)."""
  words = shlex.split(line, comments=True)
  prefix = next(p for p in PREFIXES if tuple(words[:len(p)]) == p)
  return words[len(prefix):]


COMMANDS = readme_commands()
RUN = [c for c in COMMANDS if argv_of(c)[:1] == [] or argv_of(c)[0] not in PARSE_ONLY]


def test_readme_has_the_commands_it_should():
  assert len(COMMANDS) >= 10, COMMANDS
  commands = {argv_of(c)[0] for c in COMMANDS}
  assert {"generate", "capacity", "demo", "serve", "bench", "--helpfull"} <= commands
  assert argv_of(".venv/bin/hisparse-jax generate --prompt='a\\nb'   # x") == [
      "generate", "--prompt=a\\nb"]


def _run(line: str) -> subprocess.CompletedProcess:
  argv = argv_of(line)
  argv += SMALLER.get(argv[0], ())
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # XLA's GPU autotuner as a user runs `compile` (conftest.py turns it off for the suite).
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_gpu_autotune_level"))
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *argv], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results():
  """Every runnable line's process, two at a time."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    return dict(zip(RUN, pool.map(_run, RUN)))


@pytest.mark.parametrize("line", RUN)
def test_readme_line_runs_as_written(line, results):
  r = results[line]
  refusal = re.search(r"#\s*exit (\d+)", line)
  if refusal:  # a refusal: its exit status and one error line, nothing else
    assert r.returncode == int(refusal.group(1)), f"{line}\n{r.stderr[-3000:]}"
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return
  assert r.returncode == 0, f"{line}\n{r.stderr[-3000:]}"
  assert "Traceback" not in r.stderr
  answer = re.search(r"#\s*answers:\s*(.+?)\s*$", line)
  if answer:  # the output's first words are the answer's
    first = re.match(r'\[0\] "(.*)" \(', r.stdout.splitlines()[0])
    want = answer.group(1).split()
    assert first and first.group(1).split()[:len(want)] == want, r.stdout
  right = re.search(r"^(\d+)/(\d+) right$", r.stdout, flags=re.M)
  if right:
    assert right.group(1) == right.group(2), r.stdout


@pytest.mark.parametrize("line", [c for c in COMMANDS if c not in RUN])
def test_readme_line_that_cannot_run_here_parses(line):
  command, *flag_args = argv_of(line)
  assert command in cli.COMMANDS and command in PARSE_ONLY
  try:
    flags.FLAGS(["hisparse-jax", *flag_args])  # raises on an unknown flag or a bad value
    if command == "bench":
      bench_cmd.suite_names(flags.FLAGS.suite)
  finally:
    flags.FLAGS.unparse_flags()
