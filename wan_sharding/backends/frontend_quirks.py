"""What a frontend needs to trace diffusers' Wan VAE as torch runs it: the workarounds of each
lowering, kept here with the backends that need them (the VAE's own modules stay frontend-free).

- torch-xla 2.9 (``xla``, ``tt``): :func:`clamped_negative_slices` around a traced step, and
  :func:`lowered_upsample` on the model (no lowering of ``nearest-exact``);
- dynamo (``tt``'s ``torch.compile``): :func:`cache_string_compare` on the model (a comparison of a
  tensor with a string, which splits the graph);
- torchax 0.0.13 (``jax``): :func:`sliced_integer_indexing` around a traced step, and
  :func:`torch_dtypes` on the model (dtypes torchax changes).

Each backend says which it takes: ``Backend.step_quirks()`` (the context around a traced step;
the JAX backend enters its own inside the step's program instead, ``JaxBackend.step_program``) and
``Backend.frontend_hooks(model)`` (per-instance hooks, their handles returned to be removed).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..hooks import Hook
from ..specs import ShardingError


class _Clamp:  # defined once: dynamo guards a compiled step on the types of the modes around it
    pass


class _Sliced:
    pass


def _modes() -> tuple[type, type]:
    """The two TorchFunctionMode classes, made once (torch.overrides imported on first use)."""
    global _Clamp, _Sliced
    from torch.overrides import TorchFunctionMode

    if not issubclass(_Clamp, TorchFunctionMode):
        class Clamp(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple):
                    args = (args[0], _clamp_index(args[0].shape, args[1]))
                return func(*args, **(kwargs or {}))

        class Sliced(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple):
                    index, picked = _sliced_index(args[0].shape, args[1])
                    if picked:
                        out = func(args[0], index)
                        for dim in reversed(picked):
                            out = out.squeeze(dim)
                        return out
                return func(*args, **(kwargs or {}))

        _Clamp, _Sliced = Clamp, Sliced
    return _Clamp, _Sliced


@contextlib.contextmanager
def clamped_negative_slices() -> Iterator[None]:
    """torch-xla 2.9 refuses a slice whose negative start reaches past the dim
    (``x[:, :, -2:]`` on one frame: "Value out of range"), which eager torch clamps; diffusers'
    cache takes ``x[:, :, -CACHE_T:]`` of every one-frame input. Inside this context such a
    start is clamped as torch clamps it (a TorchFunctionMode, only around the VAE's steps)."""
    with _modes()[0]():
        yield


@contextlib.contextmanager
def sliced_integer_indexing() -> Iterator[None]:
    """torchax lowers an integer index (``x[:, :, -1]``, which diffusers' cache takes of the
    previous frames in every step after the first) through ``jnp`` indexing, which makes it a
    ``dynamic_slice``; tt-mlir 0.1.3 partitions a ``dynamic_slice`` of a split tensor wrong and
    refuses the step ("has slice size 32 greater than dimension size 8 in dimension 3 of
    operand"). Inside this context such an index is a one-wide static slice and a squeeze, the same
    values (a TorchFunctionMode, only around the VAE's steps on the JAX backend)."""
    with _modes()[1]():
        yield


def _sliced_index(shape: torch.Size, index: tuple) -> tuple[tuple, list[int]]:
    """``index`` with each plain integer ``i`` as the slice ``i:i+1`` (negative ones counted from
    the end), and the dims those were; unchanged when it holds anything but integers and slices."""
    if len(index) > len(shape) or not all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in index):
        return index, []
    out, picked = [], []
    for dim, (size, i) in enumerate(zip(shape, index)):
        if isinstance(i, int):
            start = i + size if i < 0 else i
            i = slice(start, start + 1)
            picked.append(dim)
        out.append(i)
    return tuple(out), picked


def _clamp_index(shape: torch.Size, index: tuple) -> tuple:
    if any(i is Ellipsis or i is None for i in index):
        return index
    out = []
    for size, i in zip(shape, index):
        if isinstance(i, slice) and isinstance(i.start, int) and i.start < -size:
            i = slice(None, i.stop, i.step)
        out.append(i)
    return tuple(out) + tuple(index[len(out):])


class _Attribute:
    """An instance attribute set on a module, put back by ``remove()`` (a hook handle's interface)."""

    def __init__(self, module: torch.nn.Module, name: str, value: Any):
        self.module, self.name, self.value = module, name, module.__dict__[name]
        setattr(module, name, value)

    def remove(self) -> None:
        setattr(self.module, self.name, self.value)


def lowered_upsample(model: torch.nn.Module) -> list[Any]:
    """torch-xla 2.9 has no lowering for ``nearest-exact`` interpolation
    (``aten::_upsample_nearest_exact2d`` falls back to the CPU), so each ``WanUpsample`` would cut
    the lazy graph in two and move the frame to the host and back; a compile's trace then holds only
    the part after the last upsampler. At the x2 scale the VAE uses, nearest-exact and nearest read
    the same input pixel (output ``i`` reads ``floor((i + 0.5) / 2) == floor(i / 2)``), and torch-xla
    lowers ``nearest``: each ``WanUpsample`` instance gets ``mode = "nearest"`` (no hook, so a dynamo
    trace of it stays one graph). Returns the handles that put the modes back."""
    handles = []
    for module in model.modules():
        if type(module).__name__ != "WanUpsample":
            continue
        if module.mode != "nearest-exact" or tuple(module.scale_factor) != (2.0, 2.0):
            raise ShardingError(f"a WanUpsample with mode {module.mode!r} and scale {module.scale_factor}: the torch-xla "
                                "backends lower only the VAE's own nearest-exact x2")
        handles.append(_Attribute(module, "mode", "nearest"))
    return handles


def torch_dtypes(model: torch.nn.Module) -> list[Any]:
    """Torch's dtypes where torchax 0.0.13 changes them: it promotes bf16 times a Python float to
    fp32 (``WanRMS_norm``'s ``* self.scale``), returns fp32 from a bf16 SDPA (the mid-block
    attention) and keeps ``WanUpsample``'s fp32 (its ``type_as`` back to bf16 is lost), and a conv
    then refuses the fp32 input beside its bf16 bias. Each norm's and upsampler's output is cast
    back to its input's dtype and each conv's input to its weight's, as torch computes them;
    no-ops wherever the dtypes already match (fp32). Returns the hooks' handles."""
    handles = []
    for module in model.modules():
        if type(module).__name__ == "WanRMS_norm":
            handles.append(module.register_forward_hook(Hook(lambda mod, a, y: y.to(a[0].dtype))))
        elif type(module).__name__ == "WanUpsample":
            # its result reads bf16 in Python while torch's own record says fp32 (a conv then refuses
            # it): a copy made from the array has one dtype in both
            handles.append(module.register_forward_hook(Hook(lambda mod, a, y: y.to(a[0].dtype).clone())))
        elif isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
            handles.append(module.register_forward_pre_hook(Hook(lambda mod, a: (a[0].to(mod.weight.dtype), *a[1:]))))
    return handles


class CachedFrames:
    """A tensor of diffusers' ``feat_cache`` that compares with a string as eager Python compares a
    tensor with one (``!=``: True, ``==``: False): ``WanResample`` tests ``feat_cache[idx] !=
    "Rep"`` and ``== "Rep"`` on its cached frames, which dynamo cannot make a fake tensor of (the
    graph splits there at every step after the first). Indexing and ``to`` reach the tensor, which
    is all ``WanResample`` and the time conv it feeds do with the entry before replacing it."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.tensor.to(*args, **kwargs)


def cache_string_compare(model: torch.nn.Module) -> list[Any]:
    """Before each ``WanResample`` that upsamples in time: its cached frames (a tensor in the
    cache list) wrapped as :class:`CachedFrames`; the module itself then puts its new frames in
    their place, a plain tensor again. Returns the hooks' handles."""
    def wrap(mod, args, kwargs):
        cache, at = kwargs.get("feat_cache"), kwargs.get("feat_idx")
        if cache is not None and at is not None and isinstance(cache[at[0]], torch.Tensor):
            cache[at[0]] = CachedFrames(cache[at[0]])
        return None

    return [m.register_forward_pre_hook(Hook(wrap), with_kwargs=True) for m in model.modules()
            if type(m).__name__ == "WanResample" and m.mode == "upsample3d"]
