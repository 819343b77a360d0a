"""``rope_tables``: the rope cos / sin tables computed once per latent shape, outside the traced graph. Exact.

Vanilla, every forward recomputes the tables from the rope module's buffers inside the graph
(slices, expands, concatenations and a reshape to ``(1, L, 1, head_dim)``, twice). With this patch
the ``rope`` module's forward (an instance attribute; the class is untouched) returns tables it
computed on the host the first time it saw that latent shape, by running the forward it replaced
(diffusers', or the ``rope`` patch's half layout) on a CPU twin of the module, and cached on the
instance per (latent shape, dtype, device):

- eager CPU: the cached tensors themselves;
- torch-xla (``xla``): a device copy made once and reused, which enters every traced graph as
  device data (a graph input), not as computation;
- ``torch.compile`` (the ``tt`` backend): a forward pre-hook on the model, which dynamo does not
  trace (``torch.compiler.disable``), makes the device tables for the incoming latent shape before
  the forward is traced; the rope call inside the compiled forward is then a lookup, and the
  cached device tables are inputs of the one compiled graph (no graph break);
- JAX through torchax (``jax``): the host tables become constants of the traced program (a
  torchax trace cannot keep a device value between traces, so nothing device-side is cached).
  Constants are embedded in the lowered module: 2 x L x head_dim x 4 bytes, ~33 MB for A14B at
  480p. The model's rope buffers are then unused by the program.

The tables equal what the replaced forward computes from the model's buffers (the same values:
slicing and concatenating copy them), in the dtype of those buffers at call time: measured
bit-identical output (max-abs 0) in fp32 on the CPU.

Composition with sequence parallelism: the SP plan splits the rope module's outputs (a forward
hook on ``rope``, ``WAN_SP_POINTS``). Hooks run around whatever ``forward`` the instance has, so the
SP hook still pads and constrains the cached tables: the only ops left in the graph for them are
the SP pad and constraints (the pad folds into the constant on ``jax``). Works applied before or
after SP. Apply after ``rope`` (the tables follow the layout of the forward they cache;
``apply_patches`` orders one call's names itself).
"""

from __future__ import annotations

import types
import weakref

import torch

from .base import Patch, PatchContext, PatchError, Undo, instance_override, wan_classes
from .rope import half_rope_forward


def _cpu_twin(rope: torch.nn.Module) -> torch.nn.Module:
    """A stock ``WanRotaryPosEmbed`` on the CPU with the model's buffer values (recomputed from the
    config when the model is on the meta device)."""
    twin = wan_classes().WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    if rope.freqs_cos.device.type != "meta":
        twin.freqs_cos = rope.freqs_cos.detach().to("cpu", copy=True)
        twin.freqs_sin = rope.freqs_sin.detach().to("cpu", copy=True)
    return twin


class CachedRopeTables:
    """The rope module's forward while the patch is applied (see the module docstring)."""

    def __init__(self, rope: torch.nn.Module, compute, replaced):
        self._rope = weakref.ref(rope)
        self.twin = _cpu_twin(rope)
        self.compute = compute  # function(module, hidden_states) -> (cos, sin): the replaced forward
        self.replaced = replaced  # the instance's own forward before (None: the class's)
        self.host: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # (latent, dtype, device type, device index) -> the tables the forward returns
        self.cached: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, latent: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The host (CPU) tables for latent ``(F, H, W)`` in ``dtype``, computed once."""
        key = (latent, dtype)
        if key not in self.host:
            probe = torch.empty((1, 1, *latent), device="meta")  # the forward reads only its shape
            with torch.no_grad():
                cos, sin = self.compute(self.twin, probe)
            self.host[key] = (cos.to(dtype).contiguous(), sin.to(dtype).contiguous())
        return self.host[key]

    def _key(self, hidden_states: torch.Tensor) -> tuple:
        rope = self._rope()
        dtype = rope.freqs_cos.dtype if rope is not None else self.twin.freqs_cos.dtype
        device = hidden_states.device
        return tuple(hidden_states.shape[2:]), dtype, device.type, device.index

    def __call__(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A lookup dynamo traces: under torch.compile the pre-hook (prefill) has made the entry.
        found = self.cached.get(self._key(hidden_states))
        return found if found is not None else self.make(hidden_states)

    @torch.compiler.disable
    def make(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for ``hidden_states``' latent shape, dtype and device: the host ones, or a
        device copy made once. Never traced (a graph break if it ever ran under dynamo)."""
        key = self._key(hidden_states)
        host = self.tables(key[0], key[1])
        if hidden_states.device.type == "cpu":
            self.cached[key] = host
            return host
        out = (host[0].to(hidden_states.device), host[1].to(hidden_states.device))
        # A plain tensor is real device memory; a tensor subclass (torchax) may be a value of the
        # trace in progress and must not outlive it.
        if all(type(t) is torch.Tensor for t in out):
            self.cached[key] = out
        return out

    @torch.compiler.disable
    def prefill(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the model: the tables for this forward, made before dynamo traces it."""
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        if type(x) is torch.Tensor and self.cached.get(self._key(x)) is None:
            self.make(x)


class RopeTablesPatch(Patch):
    name = "rope_tables"
    exact = True
    after_sp = True
    summary = "rope cos/sin tables cached per latent shape, computed on the host outside the traced graph"

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        rope = getattr(dit, "rope", None)
        if not isinstance(rope, wan_classes().WanRotaryPosEmbed):
            raise PatchError(f"patch 'rope_tables' needs the model's WanRotaryPosEmbed as dit.rope, found "
                             f"{type(rope).__name__}; remove what replaced it first")
        own = instance_override(rope)
        if own is not None and getattr(own, "__func__", None) is not half_rope_forward:
            raise PatchError("patch 'rope_tables' caches the stock or the 'rope' patch's tables, but dit.rope.forward "
                             f"is replaced by {own!r}; remove that first")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        rope = dit.rope
        replaced = instance_override(rope)
        compute = replaced.__func__ if isinstance(replaced, types.MethodType) else type(rope).forward
        rope.forward = cached = CachedRopeTables(rope, compute, replaced)
        prefill = dit.register_forward_pre_hook(cached.prefill, with_kwargs=True)

        def undo() -> None:
            prefill.remove()
            if replaced is None:
                del rope.forward
            else:
                rope.forward = replaced

        return undo


PATCH = RopeTablesPatch()
