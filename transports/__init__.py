"""Transports move frames (a header plus raw buffers) between endpoints; see `base` for the interface.

Installed as `aiollm.transports`. The implementation is chosen by the address scheme
(`inproc://`, `tcp://`, `ucx://`) and imported lazily, so UCX is only loaded when used.
"""

from aiollm.transports.base import (
    Connection,
    Frame,
    Listener,
    TransportConfig,
    connect,
    listen,
    parse_address,
)

__all__ = ["Connection", "Frame", "Listener", "TransportConfig", "connect", "listen", "parse_address"]
