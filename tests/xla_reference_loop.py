"""Run in a torch-xla process by test_xla_reference_loop: the reference recipe's own loop."""

import sys

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
from wan_sharding.models import LatentShape, build_dit, dit_inputs

xr.use_spmd()
mesh = xs.Mesh(np.arange(8), (2, 4), ("batch", "model"))  # the reference recipe's axis names
dit = build_dit("t2v-a14b")
inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
with torch.no_grad():
    ref = dit(**inputs, return_dict=False)[0]
dit = dit.to(torch_xla.device())
specs = shard_dit_specs(dit, mesh)
for tensor, spec in specs.items():
    xs.mark_sharding(tensor, mesh, spec)
handle = apply_dit_sp_activation_sharding(dit, mesh, backend="xla")
with torch.no_grad():
    out = dit(**{k: v.to(torch_xla.device()) for k, v in inputs.items()}, return_dict=False)[0].cpu()
w = dit.blocks[0].attn1.to_q.weight
print("SHARDING", torch_xla._XLAC._get_xla_sharding_spec(w))
print("MAXABS", float((out - ref).abs().max()))
sys.exit(0)
