"""`ref.ask(msg, into=buffers)`: a remote reply's tensors land in the asker's memory, over tcp and inproc."""

import numpy as np
import pytest

from aiollm.actors.echo import Echo, EchoActor, Ping, Pong
from aiollm.testing.actor_helpers import started

pytestmark = pytest.mark.usefixtures("inline_steps")  # every test on the inline and the plain path

LISTEN = {"tcp": ("tcp://127.0.0.1:0",), "inproc": ()}


@pytest.mark.parametrize("scheme", ["tcp", "inproc"])
async def test_reply_tensors_land_in_the_given_memory(scheme) -> None:
    async with started(LISTEN[scheme]) as a, started(LISTEN[scheme]) as b:
        await b.spawn(EchoActor, "echo")
        ref = a.ref(f"{b.url}/echo")
        assert ref.url.startswith(scheme)
        sent = np.arange(1000, dtype=np.float32).reshape(10, 100)
        dest = np.zeros(4000, np.uint8)
        reply = await ref.ask(Echo("x", sent), timeout=5, into=[dest])
        assert np.shares_memory(reply.data, dest)
        np.testing.assert_array_equal(reply.data, sent)
        other = np.zeros(16, np.uint8)  # sizes differ: fresh memory, same values
        reply = await ref.ask(Echo("y", sent), timeout=5, into=[other])
        assert not np.shares_memory(reply.data, other)
        np.testing.assert_array_equal(reply.data, sent)
        assert await ref.ask(Ping(1), into=[dest]) == Pong(1)  # a reply without tensors ignores it


async def test_into_must_be_writable_and_is_ignored_locally() -> None:
    async with started(LISTEN["tcp"]) as a, started(LISTEN["tcp"]) as b:
        await b.spawn(EchoActor, "echo")
        with pytest.raises(ValueError, match="writable"):
            await a.ref(f"{b.url}/echo").ask(Ping(1), into=[b"read-only"])
        msg = Echo("local", np.ones(3))
        assert await b.ref("echo").ask(msg, into=[np.zeros(24, np.uint8)]) is msg
