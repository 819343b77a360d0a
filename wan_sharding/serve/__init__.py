"""Serving: a resident sharded pipeline behind an HTTP API, with a queue and recovery.

- :mod:`.server`: ``wan-sharding serve`` (socket, store, supervisor, uvicorn);
- :mod:`.app`: the HTTP API (FastAPI), in the shape of tt-media-server's ``/v1/videos``;
- :mod:`.store`: jobs and results in SQLite under ``--store``;
- :mod:`.supervisor`: the queue and the resident worker's recovery;
- :mod:`.worker`: the resident model process (built, sharded and warmed up once);
- :mod:`.client`: :class:`Client`, what ``wan-sharding submit`` uses.

See docs/serving.md.
"""

from .client import Client, ServeError

__all__ = ["Client", "ServeError"]
