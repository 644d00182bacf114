"""The engine behind an asyncio server: one thread owns the `Engine` and steps it; each
request's outputs fan out to an asyncio queue of the coroutine that awaits them.

    HTTP handlers (event loop)                 engine thread
      AsyncEngine.generate() --add (executor)--> Engine.add_request (under the lock)
           ^   await queue.get()                  loop: aborts -> Engine.step() -> outputs
           |                                          |
           +----- loop.call_soon_threadsafe(queue.put_nowait, output) <--+
      a stream closed early (client gone) --abort list--> Engine.abort_request

The engine is not thread-safe: the lock orders the engine thread's steps and the
handlers' `add_request` calls (made in an executor thread, so the event loop never waits
on a step). Aborts are queued and applied by the engine thread before its next step, so
a cancelled coroutine never has to await anything to give its blocks back.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Sequence

from absl import logging

from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.request import RequestOutput
from hisparse_jax.engine.sampling import SamplingParams

IDLE_WAIT_S = 0.05  # how long the idle engine thread sleeps between looks for work


class EngineDeadError(RuntimeError):
  """The engine failed beyond one step's requests (its device pool was lost)."""


class StreamOverflowError(RuntimeError):
  """A request's consumer fell `max_buffered` outputs behind (a client that reads its
  stream too slowly or not at all): the request was aborted, its blocks freed."""


class AsyncEngine:
  """`Engine` driven by a background thread for asyncio callers.

  Invariants: only the engine thread steps the engine; every request added through
  `generate` is either finished by the engine or aborted when its consumer leaves, so
  no request (and no block) outlives its stream.
  """

  def __init__(self, engine: Engine, max_stream_buffer: int = 1024):
    """max_stream_buffer: outputs a stream may hold unread before its request is aborted
    (a slow or stalled client must not grow the server's memory without bound)."""
    if max_stream_buffer < 1:
      raise ValueError(f"max_stream_buffer must be >= 1, got {max_stream_buffer}")
    self.engine = engine
    self.max_stream_buffer = max_stream_buffer
    self.num_overflowed = 0  # requests aborted by a full stream buffer
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
    self._aborts: collections.deque[str] = collections.deque()
    self._stopping = False
    self.error: BaseException | None = None  # set when the engine thread died
    self._thread = threading.Thread(target=self._run, name="hisparse-engine", daemon=True)

  # --- Lifecycle -----------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  @property
  def is_running(self) -> bool:
    return self._thread.is_alive() and not self._stopping and self.error is None

  def shutdown(self, timeout_s: float = 30.0) -> None:
    """Aborts what is left and stops the engine thread."""
    with self._lock:
      for request_id in list(self.engine.requests):
        self.engine.abort_request(request_id)
    self._stopping = True
    self._wake.set()
    if self._thread.is_alive():
      self._thread.join(timeout_s)
    if not self._thread.is_alive():  # the third tier's pending stores, its connections
      self.engine.close()

  @property
  def num_unfinished(self) -> int:
    return len(self._streams)

  # --- Engine thread ------------------------------------------------------------

  def _run(self) -> None:
    try:
      while True:
        with self._lock:
          while self._aborts:
            self.engine.abort_request(self._aborts.popleft())
          busy = self.engine.has_unfinished_requests()
          outputs = self.engine.step() if busy or self.engine.num_pending_outputs else []
        self._deliver_all(outputs)
        if self._stopping and not busy:
          return
        if not busy and not outputs:
          self._wake.wait(IDLE_WAIT_S)
          self._wake.clear()
    except BaseException as e:  # the engine cannot go on: every stream ends with it
      logging.exception("the engine loop failed")
      self.error = e
      for request_id in list(self._streams):
        self._deliver(request_id, EngineDeadError(f"the engine failed: {e}"))

  def _deliver_all(self, outputs: list[RequestOutput]) -> None:
    """Hands a step's outputs to their streams: one wake-up of each event loop per step
    (not one per output: each is a write to the loop's self-pipe, and the GIL the loop
    then holds is time the next step's host work waits)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for output in outputs:
      entry = self._streams.get(output.request_id)
      if entry is not None:
        by_loop.setdefault(entry[0], []).append((entry[1], output))
    for loop, items in by_loop.items():
      try:
        loop.call_soon_threadsafe(_put_all, items)
      except RuntimeError:  # the loop is closed: nobody is waiting
        pass

  def _deliver(self, request_id: str, item) -> None:
    entry = self._streams.get(request_id)
    if entry is not None:
      loop, stream = entry
      try:
        loop.call_soon_threadsafe(stream.queue.put_nowait, item)
      except RuntimeError:  # the consumer's loop is closed: nobody is waiting
        pass

  # --- Callers (event loop) -------------------------------------------------------

  def _add(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int] | None,
           sampling_params: SamplingParams, cache_salt: str | None = None) -> None:
    with self._lock:
      self.engine.add_request(request_id, prompt, sampling_params,
                              prompt_token_ids=prompt_token_ids, cache_salt=cache_salt)
    self._wake.set()

  def abort(self, request_id: str) -> None:
    """Ends the request before the engine's next step (thread-safe, never blocks)."""
    self._aborts.append(request_id)
    self._wake.set()

  def refresh_metrics(self) -> None:
    """Brings the engine's usage gauges and transfer counters up to date (for a scrape)."""
    with self._lock:
      self.engine.metrics()

  async def add_request(self, request_id: str, sampling_params: SamplingParams, *,
                        prompt: str | None = None,
                        prompt_token_ids: Sequence[int] | None = None,
                        cache_salt: str | None = None) -> RequestStream:
    """Adds a request; returns the stream of its outputs (as `sampling_params.output_kind`
    streams them, up to the finished one). Bad input raises ValueError naming the field.
    `cache_salt`: as `Engine.add_request`'s (shares cached KV only within one salt).
    The caller must `close()` the stream (it aborts a request still running)."""
    if not self.is_running:
      raise EngineDeadError("the engine is not running")
    if request_id in self._streams:
      raise ValueError(f"request_id {request_id!r} is already in use")
    loop = asyncio.get_running_loop()
    stream = RequestStream(self, request_id)
    self._streams[request_id] = (loop, stream)
    try:
      await loop.run_in_executor(None, self._add, request_id, prompt, prompt_token_ids,
                                 sampling_params, cache_salt)
    except BaseException:
      stream.close()  # (cancelled while adding: the request may have been added)
      raise
    return stream

  async def generate(self, request_id: str, sampling_params: SamplingParams, *,
                     prompt: str | None = None,
                     prompt_token_ids: Sequence[int] | None = None,
                     cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
    """`add_request`, then its outputs; leaving early aborts the request."""
    stream = await self.add_request(request_id, sampling_params, prompt=prompt,
                                    prompt_token_ids=prompt_token_ids, cache_salt=cache_salt)
    try:
      async for output in stream:
        yield output
    finally:
      stream.close()


def _put_all(items) -> None:
  for stream, output in items:
    stream.put(output)


class RequestStream:
  """The outputs of one request, in order, up to its finished one (an async iterator).
  `close()` ends the stream; a request not finished by then is aborted."""

  def __init__(self, engine: AsyncEngine, request_id: str):
    self.engine, self.request_id = engine, request_id
    self.queue: asyncio.Queue = asyncio.Queue()
    self.finished = self.closed = self.overflowed = False

  def put(self, output: RequestOutput) -> None:
    """An output for the consumer (on its event loop). Past `max_stream_buffer` unread
    outputs the request is aborted and the consumer gets StreamOverflowError instead."""
    if self.overflowed:
      return
    if self.queue.qsize() >= self.engine.max_stream_buffer and not output.finished:
      self.overflowed = True
      self.engine.num_overflowed += 1
      self.engine.abort(self.request_id)
      self.queue.put_nowait(StreamOverflowError(
          f"the client read its stream too slowly ({self.engine.max_stream_buffer} outputs "
          "unread): the request was aborted"))
      return
    self.queue.put_nowait(output)

  def __aiter__(self):
    return self

  async def __anext__(self) -> RequestOutput:
    if self.finished or self.closed:
      raise StopAsyncIteration
    item = await self.queue.get()
    if isinstance(item, BaseException):
      self.close()
      raise item
    if item.finished:
      self.finished = True
      self.close()
    return item

  def close(self) -> None:
    if self.closed:
      return
    self.closed = True
    self.engine._streams.pop(self.request_id, None)
    if not self.finished:  # (a request that was never added: aborting it does nothing)
      self.engine.abort(self.request_id)
