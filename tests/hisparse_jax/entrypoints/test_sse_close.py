"""`openai_streaming.sse` closes a response's request streams (aborting what still runs)
as soon as the response ends, also when its client leaves while the response waits in
`send`: starlette then cancels the send and leaves the body generator suspended at its
`yield`, never closed, so closing the streams from the body's `finally` alone would wait
for the garbage collector, and the request would run on to its last token."""

from __future__ import annotations

import asyncio

import pytest

from hisparse_jax.entrypoints.openai_streaming import sse


class FakeStream:
  """A RequestStream's close(): closing one still running aborts its request."""

  def __init__(self):
    self.closes = 0

  def close(self):
    self.closes += 1


async def _events():
  while True:
    await asyncio.sleep(0.01)  # the engine's next step
    yield {"text": "x"}


@pytest.mark.parametrize(("spec_version", "left_in"), [("2.3", "send"), ("2.4", "send"),
                                                       ("2.3", "body")])
def test_a_client_that_leaves_closes_the_streams_at_once(spec_version, left_in):
  """left_in: where the response is when its client's disconnect reaches it: in a `send`
  that waits (a middleware's stream, or 2.4's OSError), or waiting for the next event."""
  streams = [FakeStream(), FakeStream()]
  on_close = []
  response = sse(_events(), streams, on_close=lambda: on_close.append(1))
  gone = asyncio.Event()
  sent = []

  async def receive():
    await gone.wait()
    return {"type": "http.disconnect"}

  async def send(message):
    sent.append(message)
    if len(sent) == 3:  # two events sent, then the client goes
      gone.set()
      if spec_version == "2.4":  # (ASGI 2.4: a send to a gone client raises OSError)
        raise OSError("the client is gone")
      if left_in == "send":  # a middleware's stream that nobody reads any more
        await asyncio.sleep(3600)

  async def run():
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
    try:
      await asyncio.wait_for(response(scope, receive, send), 30)
    except Exception as e:  # noqa: BLE001 (2.4: starlette's ClientDisconnect)
      assert type(e).__name__ == "ClientDisconnect", e
    # The body generator may still be suspended (referenced here, so not collected).
    assert response.body_iterator is not None
    return [s.closes for s in streams], list(on_close)

  closes, called = asyncio.run(run())
  assert closes == [1, 1]
  assert called == [1]


def test_a_stream_that_ends_closes_its_streams_once():
  streams = [FakeStream()]
  on_close = []

  async def two():
    yield {"a": 1}
    yield {"a": 2}

  response = sse(two(), streams, on_close=lambda: on_close.append(1))
  sent = []

  async def receive():
    await asyncio.sleep(3600)

  async def send(message):
    sent.append(message)

  asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
  bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
  assert bodies.decode() == 'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: [DONE]\n\n'
  assert [s.closes for s in streams] == [1] and on_close == [1]
