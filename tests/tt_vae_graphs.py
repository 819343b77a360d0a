"""Run in a torch-xla CPU process by ``test_tt_vae_contract.py``: the VAE and the text encoder on
the ``tt`` backend under real dynamo, with ``tt_graphs.py``'s stand-ins for Tenstorrent's torch
plugin (the ``tt::sharding_constraint`` op as tt-xla registers it, a graph-counting ``tt`` dynamo
backend, ``inline_inbuilt_nn_modules=False``); everything else real: ``shard_vae`` /
``shard_text_encoder`` with the real ``TTBackend``, torch-xla SPMD on 8 CPU devices, dynamo.

Per call it records the graphs dynamo compiled (their constraints, inputs and own parameters),
the constraints run outside any graph, torch-xla's counters (programs compiled, run, a sharded
tensor replicated for the host; bytes sent to the devices) and the output against the unsharded
model's own ``decode`` / ``encode`` / forward on the CPU. Prints one JSON object.

Usage: ``python tt_vae_graphs.py PART...`` (``decode``, ``encode``, ``text``).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tt_graphs as T  # noqa: E402  (registers the stand-ins)
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

COUNTERS = ("UncachedCompile", "CachedCompile", "ExecuteReplicated", "ReplicateShardedData")


def _counted(run) -> dict:
    """``run()`` with every record cleared first; what it made."""
    T.EAGER_CALLS.clear(), T.GRAPHS.clear(), T.PLACEHOLDERS.clear(), T.PARAMETERS.clear()
    torch._dynamo.utils.counters.clear()
    met.clear_all()
    out = run()
    sent = met.metric_data("OutboundData")  # host -> devices, bytes
    return {"out": out, "graphs": [len(g) for g in T.GRAPHS], "inputs": list(T.PLACEHOLDERS),
            "parameters": list(T.PARAMETERS), "eager": len(T.EAGER_CALLS),
            "counters": {k: met.counter_value(k) or 0 for k in COUNTERS},
            "sent_bytes": int(sent[1]) if sent else 0,
            "breaks": {str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()}}


def _grade(out: torch.Tensor, ref: torch.Tensor) -> dict:
    max_abs, pcc = T._max_abs_and_pcc(out, ref)
    return {"max_abs": max_abs, "pcc": pcc, "shape": list(out.shape)}


def vae(part: str) -> dict:
    """The tiny Wan 2.1 VAE: a decode of 4 latent frames of 5x8 (padded to 6x8 on 2x4: H on the
    2-long axis) or an encode of 9 video frames of 40x64 (the first frame and two chunks of four:
    the third step is the one every later chunk reuses), twice (the second call warm), compared
    with the VAE's own."""
    from wan_sharding.models import build_vae
    from wan_sharding.vae import shard_vae

    backend = T._backend("2x4")
    model = build_vae("wan2.1")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 16, 4, 5, 8, generator=g) if part == "decode" else torch.randn(1, 3, 9, 40, 64, generator=g))
    call = (lambda m: m.decode(x).sample) if part == "decode" else (lambda m: m.encode(x).latent_dist.mode())
    with torch.no_grad():
        ref = call(model)
    handle = shard_vae(model, "2x4", backend=backend)
    frame = handle.plan_decode(tuple(x.shape)) if part == "decode" else handle.plan_encode(tuple(x.shape))
    piece = torch.zeros(*x.shape[:2], 1, *frame.padded)
    uploaded = _counted(lambda: torch_xla.sync() or backend.upload(piece, frame.split.frame_spec(5)))
    first = _counted(lambda: call(handle))
    warm = _counted(lambda: call(handle))
    steps = 4 if part == "decode" else 3
    result = {"first": first, "warm": warm, "steps": steps, "compiles": backend.compiles,
              "options": T.OPTIONS, "input_bytes": piece.numel() * 4,
              "upload_bytes": uploaded["sent_bytes"],
              "frame": [list(handle.last_frame.logical), list(handle.last_frame.padded)]}
    for r in (first, warm):
        r.update(_grade(r.pop("out"), ref))
    handle.remove()
    return result


def text() -> dict:
    """The tiny UMT5 encoder sharded on 2x4 (TP over 4, replicas over 2): the pipeline's two
    prompts (the prompt and the negative prompt: two calls of one shape), then the first again
    (warm), each against the encoder's own output."""
    from wan_sharding.models import build_text_encoder, text_encoder_inputs
    from wan_sharding.text_encoder import shard_text_encoder

    backend = T._backend("2x4")
    encoder = build_text_encoder()
    prompts = [text_encoder_inputs(valid=(11,)), text_encoder_inputs(valid=(5,), seed=4)]
    with torch.no_grad():
        refs = [encoder(ids, mask).last_hidden_state for ids, mask in prompts]
    handle = shard_text_encoder(encoder, "2x4", backend=backend)
    calls = []
    for i in (0, 1, 0):
        r = _counted(lambda: handle(*prompts[i]).last_hidden_state)
        r.update(_grade(r.pop("out"), refs[i]))
        calls.append(r)
    out = {"calls": calls, "compiles": backend.compiles}
    handle.remove()
    return out


if __name__ == "__main__":
    run = {"decode": lambda: vae("decode"), "encode": lambda: vae("encode"), "text": text}
    print("RESULT " + json.dumps({part: run[part]() for part in sys.argv[1:]}))
