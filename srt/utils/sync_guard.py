"""A guard against host synchronisation inside a forward pass.

On a GPU, every tensor → Python value (``item``, ``tolist``, ``int(t)``, ``bool(t)``,
``float(t)``, a tensor used as an index, ``x in t``, ``torch.equal``, ``torch.allclose``,
``torch.is_nonzero``, ``repr(t)`` and ``format(t)``, a tensor given where a size or a Python
number is expected: ``torch.arange(t)``, ``torch.full(size, t)``, ``t.narrow(0, s, n)``) and
every operation whose output shape depends on tensor values (``nonzero``, one-argument
``torch.where``, ``bincount``, ``unique``, boolean-mask indexing, ``repeat_interleave`` with
tensor repeats and no ``output_size``) waits for the device: the host stalls, the queue of
launched kernels drains, and the step cannot be captured in a CUDA graph. On CPU nothing
waits, so such code passes every CPU test unnoticed; this guard makes it fail there too.
``forbid_host_sync()`` raises ``HostSyncError`` at the first such call made under it, on any
device; on CUDA it also sets ``torch.cuda.set_sync_debug_mode("error")``, which catches the
synchronisations it cannot see (a device → host copy, say). Off, it costs nothing: the
caller does not enter it.

Metadata a step needs (lengths, slots, split points) is built on the host from the scheduler's
own integers before the forward and moved to the device in one transfer, so nothing inside the
forward needs the device's values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# Tensor → Python conversions, and operations whose output size depends on tensor values.
_SYNCING = frozenset(
    {
        "item", "tolist", "__int__", "__bool__", "__float__", "__index__", "__complex__",
        "__contains__", "__repr__", "__format__", "equal", "allclose", "is_nonzero",
        "nonzero", "argwhere", "bincount", "unique", "unique_consecutive", "masked_select",
        "numpy", "__array__",
    }
)  # fmt: skip
# Factories that read a tensor given as a size or a value on the host (``torch.arange(t)``).
_FACTORIES = frozenset({"arange", "full", "zeros", "ones", "empty", "randint", "randperm"})


class HostSyncError(RuntimeError):
    """A forward pass asked the device for a value (a host synchronisation on a GPU)."""


def _has_mask_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _any_tensor(values) -> bool:
    """A tensor among ``values``, or inside one of them that is a list or tuple (a size)."""
    return any(
        isinstance(v, torch.Tensor)
        or (isinstance(v, (list, tuple)) and any(isinstance(i, torch.Tensor) for i in v))
        for v in values
    )


def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _SYNCING:
        return True
    if name == "where":  # torch.where(condition): the indices of its true elements
        return len(args) + len(kwargs) == 1
    if name in _FACTORIES:
        return _any_tensor(args)
    if name == "narrow":  # a tensor start
        return _any_tensor(args[1:])
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
        return _has_mask_index(args[1])
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


_allowed = threading.local()  # per thread: the reasons host reads are allowed, the guards on


class _SyncGuardMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not getattr(_allowed, "reasons", None) and _syncs(name, args, kwargs):
            raise HostSyncError(
                f"host synchronisation inside the forward: {name} "
                "(build it on the host before the step, or keep it on the device)"
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync(device: torch.device | str | None = None) -> Iterator[None]:
    """Raise ``HostSyncError`` on any host synchronisation made under this context."""
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    guards = _allowed.__dict__.setdefault("guards", [])
    guards.append(device or torch.device("cpu"))
    try:
        with _SyncGuardMode():
            yield
    finally:
        guards.pop()
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)


def active_guard() -> torch.device | None:
    """The device of the innermost ``forbid_host_sync`` active in this thread (None: none), so
    that a thread working for this one can take the same guard."""
    guards = getattr(_allowed, "guards", None)
    return guards[-1] if guards else None


@contextlib.contextmanager
def allow_host_sync(reason: str) -> Iterator[None]:
    """Host reads that are no synchronisation where they run: code that only CPU tensors ever
    reach (the gloo wire's host counts, say). ``reason`` says why, for the reader."""
    reasons = _allowed.__dict__.setdefault("reasons", [])
    reasons.append(reason)
    try:
        yield
    finally:
        reasons.pop()
