"""``wan-sharding serve --lora NAME=PATH``: adapters registered at start, picked per job by name with
a scale, switched between jobs on the same warm worker, over real HTTP with a real SQLite store.

One server (the tiny T2V pipeline, 2x4, 1 frame of 32x32, 2 steps) with two adapters made in code
(``wan_sharding.lora.tiny``): ``distill`` on the high-noise expert, ``style`` on the low-noise one.
Three jobs back to back (``distill`` at 1.0, ``style`` at 0.5, none) each give the video of the
unsharded pipeline with those adapters, run in this process and written by the same writer. A
pickle refused at start is a row of docs/bad-inputs.md (tests/test_bad_inputs.py runs it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_serve import G, REQUEST, mp4_frames, serving

ADAPTERS = {"distill": ("transformer", 1), "style": ("transformer_2", 2)}  # name: (expert, seed)
JOBS = {"distill": [{"name": "distill", "scale": 1.0}], "style": [{"name": "style", "scale": 0.5}], "none": None}


@pytest.fixture(scope="module")
def tiny_pipe():
    import torch

    from wan_sharding.pipeline.tiny import build_tiny_pipeline
    from wan_sharding.serve.worker import WEIGHTS_SEED

    pipe = build_tiny_pipeline("t2v-a14b", seed=WEIGHTS_SEED, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory) -> dict[str, Path]:
    from wan_sharding.lora.tiny import write_adapter
    from wan_sharding.models import build_dit

    root = tmp_path_factory.mktemp("adapters")
    shapes = build_dit("t2v-a14b", "tiny", device="meta")  # both tiny experts' shapes (the server checks them)
    # std 0.3: each adapter moves the 32x32 frame by tens of levels (0.05 would move it by a few)
    return {name: write_adapter(root / f"{name}.safetensors", shapes, rank=4, seed=seed, std=0.3)
            for name, (_, seed) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_files):
    loras = [a for name, path in adapter_files.items() for a in ("--lora", f"{name}={path}:{ADAPTERS[name][0]}")]
    yield from serving(tmp_path_factory.mktemp("serve-lora-store"), *loras)


@pytest.fixture(scope="module")
def unsharded(tiny_pipe, adapter_files, tmp_path_factory) -> dict[str, list]:
    """Each job's video from the unsharded pipeline with its adapters (the worker's own loading:
    ``load_lora_weights`` by name), written as the worker writes it and decoded."""
    from wan_sharding.lora.files import LoraRequest
    from wan_sharding.lora.load import load_loras
    from wan_sharding.pipeline import write_video
    from wan_sharding.pipeline.tiny import call_kwargs

    pipe = tiny_pipe
    load_loras(pipe, [LoraRequest(str(path), 1.0, ADAPTERS[name][0], name) for name, path in adapter_files.items()])
    tmp = tmp_path_factory.mktemp("unsharded")
    out = {}
    for job, loras in JOBS.items():
        if loras:
            pipe.enable_lora()
            pipe.set_adapters([c["name"] for c in loras], [c["scale"] for c in loras])
        else:
            pipe.disable_lora()
        frames = pipe(**call_kwargs(pipe, prompt=REQUEST["prompt"], negative_prompt="", frames=1, height=32, width=32,
                                    steps=2, guidance_scale=4.0, seed=REQUEST["seed"], tiny=True, variant="t2v-a14b"),
                      output_type="np").frames[0]
        video = write_video(frames, tmp / job, video_format="mp4")
        out[job] = mp4_frames(video.read_bytes(), tmp)
    return out


@pytest.fixture(scope="module")
def ran(server) -> dict[str, dict]:
    """The three jobs, posted back to back (queued behind each other) and completed."""
    health = server.wait_healthy()
    posted = {}
    for job, loras in JOBS.items():
        r = server.post({**REQUEST, **({"loras": loras} if loras else {})})
        assert r.status_code == 202, r.text
        posted[job] = r.json()["id"]
    return {"health": health, "jobs": {job: server.wait(i) for job, i in posted.items()}}


def test_jobs_switch_adapters_on_one_warm_worker_and_match_unsharded(server, unsharded, ran, tmp_path):
    health = ran["health"]
    assert health["worker"]["adapters"] == ["distill", "style"]
    videos = {}
    for job, loras in JOBS.items():
        record = ran["jobs"][job]
        assert record["status"] == "completed", record
        assert record["request_parameters"].get("loras") == loras
        videos[job] = mp4_frames(server.video(record["id"]), tmp_path)
        # the sharded pipeline's video, decoded, within 2 levels of the unsharded one's (fp32: the
        # frames differ by ~1e-6 before the 8-bit video, the H.264 encoder may round one pixel apart)
        diff = np.abs(videos[job][0].astype(int) - unsharded[job][0].astype(int))
        assert diff.max() <= 2, (job, diff.max())
    for a, b in (("distill", "none"), ("style", "none"), ("distill", "style")):
        assert np.abs(videos[a][0].astype(int) - videos[b][0].astype(int)).max() > 20, (a, b)
    # switched by set_adapters / disable_lora on the same worker: never replaced, never resharded
    after = server.http.get("/health").json()
    assert after["worker_pid"] == health["worker_pid"] and after["worker_restarts"] == 0
    assert sum("ready (pid" in line for line in server.lines) == 1


def test_an_unknown_adapter_or_a_bad_scale_is_refused_and_nothing_is_stored(server, ran):
    before = server.http.get("/v1/videos/jobs").json()
    r = server.post({**REQUEST, "loras": [{"name": "turbo", "scale": 1.0}]})
    assert r.status_code == 400
    assert r.json()["error"] == "loras[0].name 'turbo': no such adapter; this server's adapters are distill, style"
    for body, line in [(b'[{"name": "distill", "scale": NaN}]', "loras[0].scale nan: not a finite number"),
                       (b'[{"name": "distill", "scale": 1e400}]', "loras[0].scale inf: not a finite number"),
                       (b'[{"name": "style"}, {"name": "style", "scale": 2}]', "loras[1].name 'style': named twice"),
                       (b'[{"name": "style", "path": "/tmp/x.safetensors"}]', "loras[0].path: Extra inputs are not "
                                                                             "permitted")]:
        r = server.http.post(G, content=b'{"prompt": "a fox", "loras": ' + body + b"}",
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and line in r.json()["error"], r.text
    assert server.http.get("/v1/videos/jobs").json() == before


def test_metrics_count_jobs_per_adapter(server, ran):
    text = server.http.get("/metrics").text
    assert 'wan_sharding_adapter_jobs_total{adapter="distill"} 1' in text
    assert 'wan_sharding_adapter_jobs_total{adapter="style"} 1' in text
