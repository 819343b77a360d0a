"""Image to video on ``wan-sharding serve``, for real: an I2V-A14B server process on 127.0.0.1 (the tiny
pipeline, 2x4 cut into two 1x4 guidance groups with `--cfg 2`, 5 frames of 32x32, 2 steps), driven over HTTP with tt-media-server's I2V routes
(``POST /v1/videos/generations/i2v`` with ``image_prompts``, and ``.../i2v/upload``), its store a
real SQLite file. The last test stops it with an I2V job queued and starts another server on the
same store, which runs that job from the image kept in the store. TI2V-5B's image to video runs in
tests/test_serve_replicas.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
from test_serve import CLI, G, Server, _env, mp4_frames, serving

from wan_sharding.serve import Client

FIVE = ["--steps", "2", "--frames", "5", "--height", "32", "--width", "32"]
# CFG parallel as well (--cfg 2: 2x4 as two 1x4 groups, a job's cond and uncond calls as one program),
# so that serving both ways costs no second server
I2V = ["--variant", "i2v-a14b", "--queue", "2", "--cfg", "2"]


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> bytes:
    """A small PNG made here: a colour ramp (so that the VAE sees structure) tinted ``color``."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 1, size[0] * size[1] * 3).reshape(size[1], size[0], 3)
    pixels = (ramp * np.array(color)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()


FIRST, LAST = png((250, 120, 30)), png((20, 90, 240))


def _wide_png(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` with next to no pixel data: its size is read
    from the header, and refused, before a decoder would inflate it."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


WIDE = _wide_png(6000, 6000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def i2v_body(*prompts: tuple[bytes, int], **fields) -> dict:
    return {"prompt": "the fox turns its head", "seed": 7,
            "image_prompts": [{"image": b64(data), "frame_pos": pos} for data, pos in prompts], **fields}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-i2v-store")


@pytest.fixture(scope="module")
def gs_called(tmp_path_factory) -> Path:
    """Where a stand-in ``gs`` (first on the server's PATH) writes its arguments if PIL ever runs
    Ghostscript (it does for EPS files it is allowed to open)."""
    bin_dir = tmp_path_factory.mktemp("gs-bin")
    called = bin_dir / "called"
    (bin_dir / "gs").write_text(f"#!/bin/sh\necho \"$@\" >> {called}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    return called


@pytest.fixture(scope="module")
def server(store, gs_called):
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{gs_called.parent}{os.pathsep}{path}"  # the server process inherits it
    try:
        yield from serving(store, *I2V, api_key=None, size=FIVE)
    finally:
        os.environ["PATH"] = path


@pytest.fixture(scope="module")
def first_only(server) -> dict:
    """The job conditioned on FIRST at frame 0: its record and its video's bytes."""
    r = server.http.post(f"{G}/i2v", json=i2v_body((FIRST, 0)))
    assert r.status_code == 202, r.text
    job = server.wait(r.json()["id"])
    assert job["status"] == "completed", job
    return {"job": job, "video": server.video(job["id"])}


def test_an_i2v_job_conditions_on_the_first_and_the_last_frame(server, store, first_only, tmp_path):
    assert [w["mesh"] for w in server.http.get("/health").json()["workers"]] == ["2x4-cfg2"]
    job = first_only["job"]
    frames = mp4_frames(first_only["video"], tmp_path)
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3) and job["video_shape"] == [5, 32, 32, 3]
    assert job["request_parameters"]["image_prompts"] == [
        {"frame_pos": 0, "image_bytes": len(FIRST), "image_sha256": hashlib.sha256(FIRST).hexdigest()}]
    with sqlite3.connect(store / "jobs.sqlite3") as db:  # the image itself is kept with its job
        assert db.execute("SELECT frame_pos, data FROM job_images WHERE job_id=?", (job["id"],)).fetchall() == [
            (0, FIRST)]
    # frame_pos num_frames - 1 is the pipeline's last_image: it changes the video
    r = server.http.post(f"{G}/i2v", json=i2v_body((FIRST, 0), (LAST, 4)))
    assert r.status_code == 202, r.text
    both = server.wait(r.json()["id"])
    assert both["status"] == "completed", both
    video = server.video(both["id"])
    assert len(mp4_frames(video, tmp_path)) == 5 and video != first_only["video"]


def test_the_upload_route_the_python_client_and_submit_image(server, first_only, tmp_path):
    """The same request three more ways: multipart upload, Client(image=...), `submit --image`: the same video."""
    r = server.http.post(f"{G}/i2v/upload", files={"image": ("first.png", FIRST, "image/png")},
                         data={"prompt": "the fox turns its head", "seed": "7", "frame_pos": "0"})
    assert r.status_code == 202, r.text
    job = server.wait(r.json()["id"])
    assert job["status"] == "completed" and server.video(job["id"]) == first_only["video"]
    path = tmp_path / "first.png"
    path.write_bytes(FIRST)
    with Client(server.url) as client:
        job, video = client.generate(tmp_path / "py", prompt="the fox turns its head", seed=7, image=path)
    assert job["status"] == "completed" and video.read_bytes() == first_only["video"]
    proc = subprocess.run([*CLI, "submit", "--server", server.url, "--prompt", "the fox turns its head", "--seed", "7",
                           "--image", str(path), "--out", str(tmp_path / "cli")], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = (tmp_path / "cli").iterdir()
    assert written.suffix == ".mp4" and written.read_bytes() == first_only["video"]


def _cases() -> list:
    broken = FIRST[: len(FIRST) // 2]  # a PNG cut in half: its header reads, its pixels do not
    huge = b"\x89PNG" + bytes(10 * 1024 * 1024)
    json_cases = [
        (G, {"prompt": "no image"}, "this server runs i2v-a14b, which needs an image: POST /v1/videos/generations/i2v"),
        (f"{G}/i2v", i2v_body((FIRST, 2)), "frame_pos 2: i2v-a14b conditions only on frame 0 (the first) and frame 4 "
                                           "(the last, num_frames - 1) of this 5-frame video; use 0 or 4"),
        (f"{G}/i2v", i2v_body((LAST, 4)), "frame_pos 4: i2v-a14b takes a last frame only with a first one"),
        (f"{G}/i2v", i2v_body((FIRST, 0), (LAST, 0)), "frame_pos 0 is given twice"),
        (f"{G}/i2v", i2v_body((FIRST, 0), (LAST, 8)), "frame_pos 8: i2v-a14b conditions only on frame 0"),
        (f"{G}/i2v", {**i2v_body(), "image_prompts": [{"image": "not base64!", "frame_pos": 0}]},
         "image_prompts[0].image: not base64"),
        (f"{G}/i2v", i2v_body((b"hello", 0)), "image_prompts[0].image: not a PNG, JPEG or WebP file (by its first "
                                              "bytes); send one of those"),
        (f"{G}/i2v", i2v_body((broken, 0)), "image_prompts[0].image: does not decode as a PNG image"),
        (f"{G}/i2v", i2v_body((FIRST, 0), (LAST, 4), (FIRST, 4)), "image_prompts: 3 images is over the 2 this server "
                                                                  "takes (--max-images)"),
        (f"{G}/i2v", i2v_body((WIDE, 0)), "image_prompts[0].image: 6000x6000 is over 33,554,432 pixels"),
        (f"{G}/i2v", i2v_body((huge, 0)), "is over the 10,485,760-byte image limit"),
    ]
    cases = [pytest.param(route, body, None, 422, line, id=f"json-{i}") for i, (route, body, line) in
             enumerate(json_cases)]
    form = {"prompt": "the fox turns its head", "frame_pos": "0"}
    cases += [
        pytest.param(f"{G}/i2v/upload", None, ("a.txt", b"hello", "text/plain"), 415,
                     "image: content type 'text/plain' is not an image this server takes", id="upload-type"),
        pytest.param(f"{G}/i2v/upload", None, ("a.png", huge, "image/png"), 413,
                     "image: over the 10,485,760-byte image limit", id="upload-size"),
        pytest.param(f"{G}/i2v/upload", None, ("a.png", broken, "image/png"), 422,
                     "image: does not decode as a PNG image", id="upload-broken"),
        pytest.param(f"{G}/i2v/upload", {**form, "frame_pos": "2"}, ("a.png", FIRST, "image/png"), 422,
                     "frame_pos 2: i2v-a14b conditions only on frame 0", id="upload-frame"),
        pytest.param(f"{G}/i2v/upload", {**form, "seed": "seven"}, ("a.png", FIRST, "image/png"), 422,
                     "seed: Input should be a valid integer", id="upload-seed"),
    ]
    return cases


@pytest.mark.parametrize("route,body,upload,status,line", _cases())
def test_bad_i2v_requests_get_one_line_4xx_and_nothing_is_queued(server, first_only, route, body, upload, status,
                                                                 line):
    before = server.http.get("/v1/videos/jobs").json()
    if upload is None:
        r = server.http.post(route, json=body)
    else:
        r = server.http.post(route, files={"image": upload}, data=body or {"prompt": "the fox turns its head"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert line in error and "\n" not in error, error
    assert server.http.get("/v1/videos/jobs").json() == before


def _other_formats() -> dict[str, bytes]:
    """A small image in each format PIL reads but the API does not take (made here by PIL)."""
    from PIL import Image

    im = Image.new("RGB", (16, 16), (200, 30, 30))
    out = {}
    for fmt in ("BMP", "TIFF", "GIF", "ICO", "PPM", "TGA", "PCX", "SGI", "EPS"):
        buf = io.BytesIO()
        im.save(buf, fmt)
        out[fmt] = buf.getvalue()
    return out


def test_only_png_jpeg_and_webp_are_decoded_by_content(server, first_only, gs_called):
    """Every other format PIL reads is refused by its first bytes, on both routes and whatever its
    label, before a decoder (or Ghostscript, for EPS) is reached; nothing is queued."""
    before = server.http.get("/v1/videos/jobs").json()
    for fmt, data in _other_formats().items():
        r = server.http.post(f"{G}/i2v", json=i2v_body((data, 0)))
        assert r.status_code == 422 and "not a PNG, JPEG or WebP file (by its first bytes)" in r.json()["error"], fmt
        r = server.http.post(f"{G}/i2v/upload", files={"image": ("a.png", data, "image/png")},
                             data={"prompt": "the fox turns its head"})
        assert r.status_code == 415 and "gs" not in r.json()["error"], (fmt, r.text)
    assert not gs_called.exists()  # Ghostscript never ran
    assert server.http.get("/v1/videos/jobs").json() == before


def test_submit_refuses_a_file_that_is_not_an_image_before_sending(server, first_only, tmp_path):
    before = server.http.get("/v1/videos/jobs").json()
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    proc = subprocess.run([*CLI, "submit", "--server", server.url, "--image", str(bad), "--out", str(tmp_path / "o")],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"--image {bad}: not a PNG, JPEG or WebP file (by its first bytes); send one of those" in line
    assert server.http.get("/v1/videos/jobs").json() == before and not (tmp_path / "o").exists()


def test_a_queued_i2v_job_survives_a_restart_of_the_server(server, store, first_only):
    """Stops the module's server: last in this file."""
    long = server.http.post(f"{G}/i2v", json=i2v_body((LAST, 0), num_inference_steps=300)).json()
    server.wait(long["id"], until=("in_progress",), progress=1)
    queued = server.http.post(f"{G}/i2v", json=i2v_body((FIRST, 0))).json()
    assert queued["status"] == "queued"
    assert server.stop(signal.SIGINT) == 130, server.stderr[-2000:]
    second = Server(store, *I2V, api_key=None, size=FIVE)
    try:
        assert second.job(long["id"])["error"]["code"] == "server_stopped"
        done = second.wait(queued["id"], timeout=240)  # run from the image kept in the store
        assert done["status"] == "completed", done
        assert second.video(queued["id"]) == first_only["video"]
    finally:
        second.kill_all()
