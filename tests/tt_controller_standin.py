"""Stand-in for the resident tt worker of ``wan-sharding serve``, run by tests/test_multihost.py.

Tenstorrent's stack cannot be installed here, so this takes the place of the model process
(``wan_sharding.serve.worker``) on a multi-host launch, where that process is tt-xla's controller:
it appends the environment it was started with to the file ``$WAN_STANDIN_ENV_LOG`` (one JSON line
per start), then speaks the resident protocol: reads its configuration line, reports ready, and
waits for jobs until its stdin closes. The supervisor, the replacement of a dead worker and the
environment it is started with are the package's own.
"""

import json
import os
import sys

with open(os.environ["WAN_STANDIN_ENV_LOG"], "a") as log:
    log.write(json.dumps(dict(os.environ)) + "\n")
sys.stdin.readline()  # the configuration
print("RESULT " + json.dumps({"event": "ready", "warmup_seconds": 0.0}), flush=True)
for _ in sys.stdin:
    pass
