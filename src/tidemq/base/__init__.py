"""The bottom layer of I/O plumbing that every other layer may use.

``protocol`` is sans-IO (codecs and frames, no sockets, no event loop, no files); what both
servers need on top of it for real sockets lives here, once:

- :mod:`tidemq.base.connection` -- :class:`ServerConnection`, the asyncio server side of one
  client connection: framing, write coalescing, back-pressure and the memory limits;
- :mod:`tidemq.base.server` -- :class:`FrameServer`, the listening socket and its
  connections: the connection cap and the per-process budget of partial frames;
- :mod:`tidemq.base.limits` -- :class:`ConnectionLimits`, those limits as one value;
- :mod:`tidemq.base.errors` -- :class:`RequestRejected`, the error a request handler raises.

The broker (``broker/connection.py``) and the name server (``namesrv/server.py``) both serve on
it. Other plumbing every layer needs belongs here too (the atomic "write, fsync, rename" of a
file, the TLS setup), not in a copy per layer. Layer rule (import-linter): ``base`` may import
``protocol`` and nothing else of tidemq; ``protocol`` never imports ``base``.
"""
