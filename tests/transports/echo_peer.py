"""A child process for cross-process transport tests: `python -m tests.transports.echo_peer URL`.

Listens on URL (port 0 allowed), prints the bound address on one stdout line, then echoes every
frame it receives back on the same connection until killed. Runs on uvloop, as nodes do.
"""

import asyncio
import sys

import uvloop

from aiollm.errors import AiollmError
from aiollm.transports import Connection, listen


async def echo(conn: Connection) -> None:
    try:
        while True:
            frame = await conn.recv()
            await conn.send(frame.header, frame.buffers)
    except AiollmError:
        await conn.close()


async def main(url: str) -> None:
    listener = await listen(url, echo)
    print(listener.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
