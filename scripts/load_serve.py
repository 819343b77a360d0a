"""A load test of ``wan-sharding serve``: many concurrent clients, good and bad requests mixed, and a
store fault in the middle; does every accepted job end, and is nothing lost?

One server (the tiny t2v-a14b pipeline, jax, 2x4 CPU mesh, 2 steps of 1 frame at 32x32, an API key,
``--queue 16``), C client threads for D seconds, each looping over a seeded mix of requests:

- good: a text-to-video job (a prompt from a short list, its own seed);
- bad by rule: 10^6 steps, a width of 2^64, ``NaN`` guidance, a prompt with a lone UTF-16 surrogate,
  an unknown field, a 100 KiB body, no API key (each must get 401, 413 or 422, never a 500);
- reads: a page of the job list, one job.

A 429 or 503 (the queue full, the store not writable) is "refused, busy": the client waits as
``Retry-After`` says (at most 1 s) and goes on. Midway another SQLite connection holds the store's
write lock (``BEGIN EXCLUSIVE``) for F seconds, as a backup or the sqlite3 shell would. After the
traffic every accepted job is waited for (bounded); a job accepted and then not found, or not ended
in time, is lost.

    .venv/bin/python scripts/load_serve.py                  # C=16, D=60 s, F=6 s: about 2-3 min on 2 cores
    .venv/bin/python scripts/load_serve.py --clients 32 --seconds 120

Writes results/serve_load.json, prints its counts and rewrites docs/serving.md's figures from it
(``scripts/docs_figures.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import httpx

from wan_sharding.runtime.workers import atomic_write

CLI = [sys.executable, "-m", "wan_sharding.cli"]
KEY = "load-test-key"
G = "/v1/videos/generations"
SETTINGS = ["--backend", "jax", "--mesh", "2x4", "--steps", "2", "--frames", "1", "--height", "32", "--width", "32",
            "--queue", "16", "--api-key", KEY]
PROMPTS = ["a red fox in the snow", "a blue bird over a lake", "a white horse walking", "a cat at night"]
# (name, body bytes, headers): requests the rules refuse
BAD = [("steps", json.dumps({"prompt": "a fox", "num_inference_steps": 10**6}).encode(), {}),
       ("width", ('{"prompt": "a fox", "width": %d}' % 2**64).encode(), {}),
       ("nan", b'{"prompt": "a fox", "guidance_scale": NaN}', {}),
       ("surrogate", b'{"prompt": "a \\ud800 fox"}', {}),
       ("field", json.dumps({"prompt": "a fox", "output": "/etc/passwd"}).encode(), {}),
       ("body", json.dumps({"prompt": "x" * 100_000}).encode(), {}),
       ("key", json.dumps({"prompt": "a fox"}).encode(), {"Authorization": "Bearer wrong"})]


def start_server(store: Path) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([*CLI, "serve", *SETTINGS, "--port", "0", "--store", str(store)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
            return proc, m.group(1), lines
    raise SystemExit("the server exited before it listened")


def wait_ready(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout} s")


class Tally:
    """What the clients saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = Counter()  # by kind: good, bad, read
        self.outcomes = Counter()  # accepted, refused_by_rule, refused_busy, server_error, transport_error, ...
        self.statuses = Counter()
        self.good_refused: list[str] = []
        self.accepted: list[str] = []

    def add(self, kind: str, outcome: str, status: int | None, job_id: str | None = None, text: str = "") -> None:
        with self.lock:
            self.sent[kind] += 1
            self.outcomes[outcome] += 1
            if status is not None:
                self.statuses[str(status)] += 1
            if job_id:
                self.accepted.append(job_id)
            if kind == "good" and outcome == "refused_by_rule":
                self.good_refused.append(text[:200])


def client_loop(url: str, index: int, until: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=60) as http:
        while time.monotonic() < until:
            pick = rng.random()
            try:
                if pick < 0.5:
                    body = json.dumps({"prompt": rng.choice(PROMPTS), "seed": rng.randrange(1000)}).encode()
                    kind, r = "good", http.post(G, content=body, headers=auth)
                elif pick < 0.85:
                    _, body, extra = rng.choice(BAD)
                    kind, r = "bad", http.post(G, content=body, headers={**auth, **extra})
                else:
                    path = "/v1/videos/jobs?limit=20" if rng.random() < 0.5 else f"{G}/{rng.choice(tally.accepted or ['x'])}"
                    kind, r = "read", http.get(path, headers=auth)
            except httpx.HTTPError as e:
                tally.add("good" if pick < 0.5 else "bad" if pick < 0.85 else "read", "transport_error", None,
                          text=type(e).__name__)
                time.sleep(0.2)
                continue
            code = r.status_code
            if kind == "read":
                tally.add(kind, "read_ok" if code in (200, 404) else "server_error" if code >= 500 and code != 503
                          else "read_other", code)
            elif code == 202:
                tally.add(kind, "accepted", code, r.json()["id"])
            elif code in (401, 413, 422):
                tally.add(kind, "refused_by_rule", code, text=r.text)
            elif code in (429, 503):
                tally.add(kind, "refused_busy", code)
                time.sleep(min(1.0, float(r.headers.get("retry-after", "1"))))
            else:
                tally.add(kind, "server_error", code, text=r.text)
            time.sleep(rng.uniform(0.0, 0.05))


def store_fault(store: Path, at: float, seconds: float, url: str, out: dict) -> None:
    """Hold the store's write lock for ``seconds`` from ``at``; what /health said during and after."""
    time.sleep(max(0.0, at - time.monotonic()))
    holder = sqlite3.connect(store / "jobs.sqlite3", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    t = time.monotonic()
    seen = Counter()
    while time.monotonic() - t < seconds:
        r = httpx.get(f"{url}/health", timeout=30)
        seen[f"{r.status_code} {r.json()['status']}"] += 1
        time.sleep(0.5)
    holder.execute("ROLLBACK")
    holder.close()
    released = time.monotonic()
    while True:
        r = httpx.get(f"{url}/health", timeout=30)
        if r.status_code == 200 or time.monotonic() - released > 60:
            break
        time.sleep(0.2)
    out.update(seconds=seconds, health_during=dict(seen), health_after=r.status_code,
               seconds_to_health_200=round(time.monotonic() - released, 2))


def settle(url: str, ids: list[str], timeout: float) -> tuple[Counter, Counter, list[str]]:
    """Wait for every accepted job to end; (statuses, error codes, ids lost)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + timeout
    pending, done = set(ids), {}
    with httpx.Client(base_url=url, timeout=60, headers=auth) as http:
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                r = http.get(f"{G}/{job_id}")
                if r.status_code == 200 and r.json()["status"] in ("completed", "failed", "cancelled"):
                    done[job_id] = r.json()
                    pending.discard(job_id)
            time.sleep(0.5)
    statuses = Counter(j["status"] for j in done.values())
    codes = Counter(j["error"]["code"] for j in done.values() if j.get("error"))
    return statuses, codes, sorted(pending)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--fault-seconds", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/serve_load.json")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        store = Path(tmp) / "store"
        proc, url, lines = start_server(store)
        try:
            wait_ready(url)
            tally, fault = Tally(), {}
            t0 = time.monotonic()
            until = t0 + args.seconds
            threads = [threading.Thread(target=client_loop, args=(url, i, until, tally, args.seed))
                       for i in range(args.clients)]
            threads.append(threading.Thread(target=store_fault, args=(store, t0 + args.seconds * 0.4,
                                                                      args.fault_seconds, url, fault)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            statuses, codes, lost = settle(url, tally.accepted, timeout=240)
            rollback_hidden = any("cannot rollback" in line for line in lines)
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at "
                   "the end",
        "settings": {"clients": args.clients, "seconds": args.seconds, "server": " ".join(SETTINGS[:-2]),
                     "bad_kinds": [b[0] for b in BAD]},
        "sent": dict(tally.sent), "outcomes": dict(tally.outcomes), "http_statuses": dict(tally.statuses),
        "accepted": len(tally.accepted), "completed": statuses.get("completed", 0),
        "failed": statuses.get("failed", 0), "cancelled": statuses.get("cancelled", 0),
        "failed_codes": dict(codes), "lost": len(lost), "lost_ids": lost,
        "good_refused_by_rule": tally.good_refused[:5], "server_errors": tally.outcomes.get("server_error", 0),
        "fault": {**fault, "rollback_error_logged": rollback_hidden},
    }
    atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("sent", "outcomes", "accepted", "completed", "failed", "failed_codes",
                                             "lost", "server_errors", "fault")}, indent=1))
    if Path(args.out).resolve() == Path("results/serve_load.json").resolve():
        subprocess.run([sys.executable, str(Path(__file__).parent / "docs_figures.py")], check=False)
    return 0 if not lost and not result["server_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
