"""Serving: resident sharded pipelines behind tt-media-server's video API, with a queue and recovery.

- :mod:`.server`: ``wan-sharding serve`` (workers, socket, store, supervisor, uvicorn);
- :mod:`.app`: the HTTP API (FastAPI): tt-media-server's ``/v1/videos`` routes, T2V and I2V;
- :mod:`.store`: jobs (tt-media-server's job record and states), I2V images and videos under ``--store``;
- :mod:`.replicas`: ``--replicas N``, the mesh split into sub-meshes;
- :mod:`.supervisor`: the queue, one resident worker per sub-mesh, and their recovery;
- :mod:`.worker`: the resident model process (built, sharded and warmed up once);
- :mod:`.client`: :class:`Client`, what ``wan-sharding submit`` uses.

See docs/serving.md.
"""

from .client import Client, ServeError

__all__ = ["Client", "ServeError"]
