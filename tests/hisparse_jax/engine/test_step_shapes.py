"""compile_in_background (step_shapes.py): a batch whose step shape is not compiled runs
padded to a compiled shape that covers it while its own program compiles in a thread.

The rules of covering are checked on their own; the engine tests run waves of requests
whose later shapes are smaller than the first ones (so they run on covering programs) and
compare every token with the foreground-compiling engine and the dense reference, with
the engine's invariants after every step, dense and HiSparse with host loads.
"""

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  add_all,
  assert_all_blocks_free,
  gib_for_blocks,
  make_engine,
  random_prompts,
  reference_greedy,
  run,
  tiny_model,
)

import kernels_pallas
from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.step_shapes import StepShape, covers
from hisparse_jax.entrypoints.cli import generate as generate_cmd  # noqa: F401
from hisparse_jax.entrypoints.cli import main as cli  # noqa: F401 (defines the flags)
from kernels_pallas import xla_attention

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Long prompts first (64-token prefill steps, 4 rows), then short ones alone: their
# prefill and decode shapes (16 tokens, fewer tiles) are covered by the first wave's.
WAVES = (random_prompts((40, 33, 52, 47), seed=1), random_prompts((5, 3), seed=2),
         random_prompts((11,), seed=3))


def test_hints_cover_counts_tiles_and_decode_rows():
  cover = xla_attention.hints_cover
  for q_lens in ([1, 1, 1], [5], [40, 1, 17], [300, 2, 1, 1]):
    assert cover(xla_attention.ragged_hints(q_lens), q_lens)  # its own hints
  big = xla_attention.ragged_hints([64, 64, 1, 1, 1])  # tile 64, 2 tiles, 8 decode rows
  assert cover(big, [5, 1, 1]) and cover(big, [64, 30]) and cover(big, [1] * 8)
  assert not cover(big, [65, 64])  # 3 tiles of 64
  assert not cover(big, [1] * 9)  # 9 decode rows
  assert not cover(xla_attention.ragged_hints([1, 1]), [5])  # no prefill tile at all
  # Backends without static sizes: only empty hints.
  none = kernels_pallas.ops("reference").hints_cover
  assert none({}, [300, 1]) and not none(big, [1])


def _shape(**overrides):
  fields = dict(num_tokens=64, num_seqs=8, table_width=8,
                ragged_hints=tuple(sorted(xla_attention.ragged_hints([40, 20, 1]).items())),
                num_sparse_rows=0, greedy_only=True)
  return StepShape(**{**fields, **overrides})


def test_covering_needs_every_size_and_the_same_program_kind():
  cover = xla_attention.hints_cover
  small = _shape(num_tokens=16, num_seqs=4, table_width=4,
                 ragged_hints=tuple(sorted(xla_attention.ragged_hints([9, 1]).items())))
  assert covers(_shape(), small, [9, 1], cover)
  assert covers(_shape(greedy_only=False), small, [9, 1], cover)  # sampling covers greedy
  assert not covers(small, _shape(), [40, 20, 1], cover)
  assert not covers(_shape(greedy_only=True), _shape(greedy_only=False), [40, 20, 1], cover)
  assert not covers(_shape(num_tokens=32), _shape(), [40, 20, 1], cover)
  assert not covers(_shape(table_width=4), _shape(), [40, 20, 1], cover)
  assert not covers(_shape(num_seqs=4), _shape(), [40, 20, 1], cover)
  # A program with the sparse path runs only batches with sparse rows, and the other way.
  assert covers(_shape(num_sparse_rows=16), _shape(num_sparse_rows=8), [40, 20, 1], cover)
  assert not covers(_shape(num_sparse_rows=8), _shape(), [40, 20, 1], cover)
  assert not covers(_shape(), _shape(num_sparse_rows=8), [40, 20, 1], cover)
  # Sampler extras: only the same signature.
  assert not covers(_shape(extras=("x",)), _shape(), [40, 20, 1], cover)
  # A program with the streamed-chunk path runs batches without a chunk, not the reverse.
  assert covers(_shape(num_sparse_rows=8), _shape(num_sparse_rows=8, sparse_chunks=False),
                [40, 20, 1], cover)
  assert not covers(_shape(num_sparse_rows=8, sparse_chunks=False),
                    _shape(num_sparse_rows=8), [40, 20, 1], cover)


def _run_waves(engine):
  tokens = []
  for w, prompts in enumerate(WAVES):
    add_all(engine, prompts, GREEDY, prefix=f"w{w}-")
    outputs = run(engine)
    tokens.append([outputs[f"w{w}-{i}"].outputs[0].token_ids for i in range(len(prompts))])
  return tokens


def test_background_compiles_keep_the_tokens_and_stall_less():
  model = tiny_model()
  reference = [reference_greedy(model, prompts, GREEDY.max_tokens) for prompts in WAVES]
  foreground = make_engine(compile_in_background=False)
  assert foreground.runner.compiler is None
  assert _run_waves(foreground) == reference
  engine = make_engine(compile_in_background=True)
  compiled, dispatch = [], engine.runner.dispatch

  def recording(batch, prev_tokens=None):
    handle = dispatch(batch, prev_tokens)
    compiled.append(handle.compiled)
    return handle

  engine.runner.dispatch = recording
  assert _run_waves(engine) == reference
  compiler = engine.runner.compiler
  # The steps that waited on a compile say so (the tier gate's prefill time leaves them out).
  assert sum(compiled) == compiler.foreground > 0
  engine.runner.compiler.wait()
  # Later waves ran on covering programs while theirs compiled, and only the first
  # shapes (nothing compiled yet covered them) made a step wait.
  assert compiler.covered > 0 and compiler.background > 0
  assert compiler.foreground < len(compiler.ready)
  m = engine.metrics()
  assert m['hisparse_step_compiles{where="background"}'] == compiler.background
  assert m['hisparse_step_compiles{where="foreground"}'] == compiler.foreground
  assert m["hisparse_steps_on_covering_shape"] == compiler.covered
  assert_all_blocks_free(engine)
  # Once the background compiles are in, the same waves run on their own programs.
  covered = compiler.covered
  compiled.clear()
  assert _run_waves(engine) == reference
  assert compiler.covered == covered and not any(compiled)
  engine.runner.compiler.close()


def test_compiled_programs_are_bounded():
  # (serve compiled a program per shape and sampler signature its requests reached, each
  # in ~240 memory maps and 20-50 MB, until a compile could not map its code and the
  # process died of a SIGSEGV: found fuzzing serve, bench/fuzz_server.py; its RSS grew
  # with each: bench/soak.py)
  model = tiny_model()
  reference = [reference_greedy(model, prompts, GREEDY.max_tokens) for prompts in WAVES]
  engine = make_engine(compile_in_background=True, max_step_programs=1)
  compiler = engine.runner.compiler
  for _ in range(2):  # (the second time, dropped programs compile again)
    assert _run_waves(engine) == reference
    compiler.wait()
    assert len(compiler.ready) == 1
  # At the cap, covered batches ran padded without compiling; uncovered ones compiled and
  # dropped the least recently run.
  assert compiler.capped > 0 and compiler.evicted > 0
  assert compiler.foreground + compiler.background - compiler.evicted == len(compiler.ready)
  assert_all_blocks_free(engine)
  compiler.close()


def test_background_compiles_with_hisparse_host_loads():
  # Offloaded HiSparse decoding (test_hisparse_engine's geometry: 17 dense blocks' budget,
  # preempted requests come back offloaded and load blocks from the host pool inside the
  # step): the padded rows of a covering program touch no hot buffer or block.
  model = tiny_model()
  mid = HiSparseConfig(top_k_tokens=24, hot_buffer_tokens=24, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16)
  prompts = random_prompts((5, 17, 40, 33, 9, 3), seed=0)
  tokens = {}
  for background in (False, True):
    engine = Engine(EngineConfig(
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
        max_num_batched_tokens=16, device_kv_gib=gib_for_blocks(model.config, 17),
        host_pool_gib=gib_for_blocks(model.config, NUM_HOST_BLOCKS), hisparse=mid,
        compile_in_background=background), model=model, model_config=model.config)
    out = []
    for wave in (prompts, prompts[3:]):
      add_all(engine, wave, SamplingParams(temperature=0.0, max_tokens=20),
              prefix=f"{len(out)}-")
      finished = run(engine)
      out.append([finished[f"{len(out)}-{i}"].outputs[0].token_ids
                  for i in range(len(wave))])
    tokens[background] = out
    m = engine.metrics()
    assert m["hisparse_offloads_total"] > 0 and m["hisparse_hot_buffer_loads_total"] > 0
    if background:
      assert engine.runner.compiler.covered > 0
      engine.runner.compiler.close()
    assert_all_blocks_free(engine)
  assert tokens[True] == tokens[False]


@pytest.mark.parametrize("command_default, argv, expected", [
    (True, [], True),  # serve
    (False, [], False),  # generate, demo
    (True, ["--nocompile_in_background"], False),
    (False, ["--compile_in_background"], True),
])
def test_the_flag_defaults_per_command(command_default, argv, expected):
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", *argv])
    kwargs = generate_cmd.engine_kwargs_from_flags(compile_in_background=command_default)
    assert kwargs["compile_in_background"] is expected
  assert EngineConfig().compile_in_background is False


def test_padding_keeps_the_batch_rows():
  # pad_to on a real batch: every added token writes nowhere, every added row attends
  # nothing, and the real rows are unchanged.
  from hisparse_jax.engine.step_shapes import pad_to, shape_of
  engine = make_engine()
  add_all(engine, WAVES[0][:2], GREEDY)
  batches = []
  build = engine.runner.build_batch

  def recording(*args, **kwargs):
    batches.append(build(*args, **kwargs))
    return batches[-1]

  engine.runner.build_batch = recording
  engine.step()
  batch = batches[0]
  shape = shape_of(batch, True)
  big = StepShape(shape.num_tokens * 2, shape.num_seqs * 2, shape.table_width * 2,
                  shape.ragged_hints, 0, True)
  padded = pad_to(batch, big, engine.runner.num_hot_rows)
  t, b = batch.input_ids.shape[0], batch.logits_indices.shape[0]
  meta, pmeta = batch.metadata, padded.metadata
  assert padded.input_ids.shape == (2 * t,) and padded.logits_indices.shape == (2 * b,)
  np.testing.assert_array_equal(padded.input_ids[:t], batch.input_ids)
  assert (pmeta.slot_ids[t:] == -1).all() and (padded.token_src[t:] == -1).all()
  np.testing.assert_array_equal(pmeta.block_tables[:b, :meta.block_tables.shape[1]],
                                meta.block_tables)
  assert (pmeta.block_tables[b:] == 0).all()
  assert (pmeta.block_tables[:, shape.table_width:] == 0).all()
  assert (pmeta.kv_lens[b:] == 0).all() and (pmeta.cu_q_lens[b:] == meta.cu_q_lens[-1]).all()
  assert (padded.temperature[b:] == 0).all() and not pmeta.sparse_rows[b:].any()
  run(engine)
