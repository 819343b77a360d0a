"""Side by side: N requests to one resident ``wan-sharding serve`` vs N standalone ``generate`` runs.

All in one run, on the tiny pipeline (random weights), jax backend, 2x4 CPU mesh, ``generate``'s
default request (4 steps, 5 frames of 64x96, seed 0):

- **latency**: N standalone ``wan-sharding generate`` processes (each imports the stacks, builds,
  shards and compiles before its first step) vs N requests to one warm server (POST to the video
  downloaded), p50 / p95 and the ratio; and whether the server's video is byte-identical to
  ``generate``'s (the tiny weights are those of ``generate --seed 0``);
- **load**: C concurrent clients, one request each, against ``--queue Q``: accepted, rejected
  with 429, completed, lost (accepted and never completed: must be 0);
- **fault**: the worker SIGKILLed mid-job: seconds to the job's ``failed``, seconds until
  ``/health`` is 200 again, and whether the same request then gives a byte-identical video;
- **throughput**: M requests posted at once to a server with 1 and then with 2 replicas
  (``--replicas``: the 2x4 mesh as two 1x4 sub-meshes, one worker each), the same settings:
  requests per minute from the first POST to the last job completed, and the ratio.

    .venv/bin/python scripts/bench_serve.py              # N=3, C=6, Q=2, M=12: ~7 min on 2 cores
    .venv/bin/python scripts/bench_serve.py --n 5 --clients 8 --throughput-jobs 20

Writes results/serve.json, prints a markdown table and rewrites docs/serving.md's figures from it
(``scripts/docs_figures.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from wan_sharding.serve import Client, ServeError
from wan_sharding.runtime.workers import atomic_write

CLI = [sys.executable, "-m", "wan_sharding.cli"]
SETTINGS = ["--backend", "jax", "--mesh", "2x4"]
REQUEST = {"prompt": "a red fox running through fresh snow, golden hour", "seed": 0}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def standalone(n: int, out: Path) -> tuple[list[float], bytes]:
    times, video = [], b""
    for i in range(n):
        t = time.perf_counter()
        proc = subprocess.run([*CLI, "generate", *SETTINGS, "--seed", "0", "--prompt", REQUEST["prompt"],
                               "--out", str(out / str(i))], capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        if proc.returncode != 0:
            raise SystemExit(f"generate failed: {proc.stderr[-2000:]}")
        video = next((out / str(i)).glob("*.mp4")).read_bytes()
        print(f"  standalone generate {i + 1}/{n}: {times[-1]:.2f} s", flush=True)
    return times, video


def start_server(store: Path, queue: int, replicas: int = 1) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*CLI, "serve", *SETTINGS, "--port", "0", "--store", str(store), "--queue", str(queue),
                             "--replicas", str(replicas)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep it drained
            return proc, m.group(1)
    raise SystemExit("the server exited before it listened")


def one_request(client: Client, out: Path, **fields) -> tuple[float, bytes]:
    t = time.perf_counter()
    job = client.wait(client.submit(**{**REQUEST, **fields})["id"], poll=0.05)
    if job["status"] != "completed":
        raise SystemExit(f"job {job['id']} {job['status']}: {job['error']}")
    data = client.download(job["id"], out).read_bytes()
    return time.perf_counter() - t, data


def load_run(client: Client, clients: int, out: Path) -> dict:
    accepted, rejected, errors = [], [], []
    barrier = threading.Barrier(clients)

    def post() -> None:
        barrier.wait()
        try:
            accepted.append(client.submit(**REQUEST)["id"])
        except ServeError as e:
            (rejected if e.status == 429 else errors).append(str(e))

    threads = [threading.Thread(target=post) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished = [client.wait(i, poll=0.05) for i in accepted]
    completed = sum(j["status"] == "completed" for j in finished)
    return {"clients": clients, "accepted": len(accepted), "rejected_429": len(rejected), "other_errors": errors,
            "completed": completed, "lost": len(accepted) - completed}


def fault_run(client: Client, reference: bytes, out: Path) -> dict:
    pid = client.health()["worker_pid"]
    job = client.submit(**{**REQUEST, "num_inference_steps": 400})
    while client.job(job["id"])["progress"]["done"] < 1:
        time.sleep(0.05)
    t = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    failed = client.wait(job["id"], poll=0.05)
    to_error = time.perf_counter() - t
    client.wait_ready(poll=0.1)
    to_ready = time.perf_counter() - t
    _, after = one_request(client, out)
    return {"job_status": failed["status"], "job_error": failed["error"], "seconds_to_error": round(to_error, 2),
            "seconds_to_ready": round(to_ready, 2), "byte_identical_after": after == reference,
            "worker_restarts": client.health()["worker_restarts"]}


def all_ready(client: Client, timeout: float = 900) -> dict:
    """/health once every worker is warm (it is 200 as soon as one is)."""
    deadline = time.monotonic() + timeout
    while True:
        health = client.wait_ready(timeout=timeout, poll=0.1)
        if all(w["state"] == "ready" for w in health["workers"]):
            return health
        if time.monotonic() > deadline:
            raise SystemExit(f"not every worker was ready within {timeout} s: {health}")
        time.sleep(0.1)


def throughput_run(store: Path, replicas: int, jobs: int) -> dict:
    """``jobs`` requests posted at once to a warm server with ``replicas`` workers: requests per
    minute from the first POST to the last completion, and how many each worker ran."""
    proc, url = start_server(store, queue=jobs, replicas=replicas)
    try:
        client = Client(url)
        all_ready(client)
        t = time.perf_counter()
        ids = [client.submit(**{**REQUEST, "seed": i})["id"] for i in range(jobs)]
        finished = [client.wait(i, poll=0.05) for i in ids]
        seconds = time.perf_counter() - t
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    failed = [j["id"] for j in finished if j["status"] != "completed"]
    if failed:
        raise SystemExit(f"throughput run with {replicas} replicas: jobs not completed: {failed}")
    per_worker = [sum(j["worker"] == w for j in finished) for w in range(replicas)]
    return {"replicas": replicas, "jobs": jobs, "seconds": round(seconds, 2),
            "requests_per_minute": round(jobs / seconds * 60, 1), "jobs_per_worker": per_worker}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3, help="requests (and standalone runs) in the latency run")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients in the load run")
    ap.add_argument("--queue", type=int, default=2, help="the server's --queue in the load run")
    ap.add_argument("--throughput-jobs", type=int, default=12, help="requests posted at once in the throughput run")
    ap.add_argument("--out", default="results/serve.json")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        tmp_path = Path(tmp)
        print(f"standalone: {args.n} x wan-sharding generate {' '.join(SETTINGS)}", flush=True)
        alone, alone_video = standalone(args.n, tmp_path / "generate")
        proc, url = start_server(tmp_path / "store", args.queue)
        try:
            client = Client(url)
            t = time.perf_counter()
            health = client.wait_ready(poll=0.1)
            ready_s = time.perf_counter() - t
            print(f"server ready in {ready_s:.1f} s (worker: {health['worker']})", flush=True)
            resident, videos = [], []
            for i in range(args.n):
                seconds, data = one_request(client, tmp_path / "served")
                resident.append(seconds)
                videos.append(data)
                print(f"  resident request {i + 1}/{args.n}: {seconds:.2f} s", flush=True)
            load = load_run(client, args.clients, tmp_path / "load")
            print(f"  load: {load}", flush=True)
            fault = fault_run(client, videos[0], tmp_path / "fault")
            print(f"  fault: {fault}", flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        throughput = [throughput_run(tmp_path / f"store-{r}", r, args.throughput_jobs) for r in (1, 2)]
        for run in throughput:
            print(f"  throughput: {run}", flush=True)
    p50 = {k: percentile(v, 50) for k, v in (("standalone", alone), ("resident", resident))}
    p95 = {k: percentile(v, 95) for k, v in (("standalone", alone), ("resident", resident))}
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "scripts/bench_serve.py " + " ".join(sys.argv[1:]),
        "setup": {"pipeline": "tiny t2v-a14b (random weights), fp32", "backend": "jax", "mesh": "2x4",
                  "request": "4 steps, 5 frames 64x96, seed 0 (throughput: seeds 0..M-1)", "video": "H.264 MP4", "n": args.n, "cpu_count": os.cpu_count(),
                  "load_average_start": round(load_before, 2), "load_average_end": round(os.getloadavg()[0], 2)},
        "standalone_seconds": [round(s, 3) for s in alone], "resident_seconds": [round(s, 3) for s in resident],
        "server_ready_seconds": round(ready_s, 2),
        "p50": {k: round(v, 3) for k, v in p50.items()}, "p95": {k: round(v, 3) for k, v in p95.items()},
        "ratio_p50": round(p50["standalone"] / p50["resident"], 1),
        "resident_identical_to_generate": all(v == alone_video for v in videos),
        "load": {**load, "queue": args.queue}, "fault": fault,
        "throughput": {"runs": throughput, "mesh": "2x4; 2 replicas: two 1x4 sub-meshes",
                       "ratio_2_over_1": round(throughput[1]["requests_per_minute"]
                                               / throughput[0]["requests_per_minute"], 2)},
    }
    atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    if Path(args.out).resolve() == (Path(__file__).resolve().parents[1] / "results" / "serve.json").resolve():
        import docs_figures  # scripts/, beside this one: docs/serving.md quotes this file

        print("\n".join(docs_figures.update(["serve"])) or "docs/serving.md unchanged")
    print(f"\n{args.out}: {result['date']}, {args.n} requests each, "
          f"load average {result['setup']['load_average_start']} -> {result['setup']['load_average_end']}\n")
    print("| | p50 s | p95 s |\n|---|---|---|")
    print(f"| standalone `generate` (new process each) | {p50['standalone']:.2f} | {p95['standalone']:.2f} |")
    print(f"| resident server (warm) | {p50['resident']:.2f} | {p95['resident']:.2f} |")
    print(f"| ratio (standalone / resident, p50) | {result['ratio_p50']}x | |")
    print(f"\nload: {load}\nfault: {fault}\nresident video identical to generate's: "
          f"{result['resident_identical_to_generate']}")
    print("\n| replicas | requests | seconds | requests / min | jobs per worker |\n|---|---|---|---|---|")
    for run in throughput:
        print(f"| {run['replicas']} | {run['jobs']} | {run['seconds']} | {run['requests_per_minute']} | "
              f"{run['jobs_per_worker']} |")
    print(f"| ratio 2 / 1 | | | {result['throughput']['ratio_2_over_1']}x | |")
    return 0 if load["lost"] == 0 and fault["byte_identical_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
