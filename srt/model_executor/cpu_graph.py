"""Decode graphs on CPU: a decode forward recorded once, then replayed without the Python
that issued it.

On CPU a decode step of a small batch is a chain of a hundred or so short calls (the C
kernels, a few PyTorch ops); the Python around them, the modules, the layer operations and the
kernels' argument checks, costs as much as the kernels' own work on a mid-size model. As a
CUDA graph does on the GPU, a ``CpuGraph`` records what a forward over static buffers ran, in
order, and replays exactly that:

- a C kernel call (``srt.layers.cpu_kernels``): the function and its arguments, which are the
  addresses of tensors the graph keeps alive, sizes and constants; consecutive calls are kept as
  one program that the library runs in one call (``srt_run``: through ctypes each call would
  cost 2-3 µs of argument conversion, as much as a small kernel's work);
- a PyTorch op, seen by a dispatch mode below autograd: one that writes its arguments
  (``copy_``, ``index_put_``) runs again on them; one that returns a new tensor runs again and
  its result is copied into the tensor the capture returned, which later calls read; views and
  allocations (``view``, ``empty``) do nothing, their tensors being kept from the capture.

So a replay runs the same kernels on the same memory in the same order as the capture did, and
its results are the eager forward's, bit for bit. What a capture cannot hold is refused there
(``CpuGraphError``): a tensor's value read on the host (``.item()``, ``.tolist()``, anything
``srt.utils.sync_guard`` forbids), which a replay would not read again; the runner then
decodes eagerly. The runner (``cuda_graph_runner``) decides which forwards are captured: the
ones a CUDA graph captures, on one rank.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from srt.layers import cpu_kernels
from srt.layers.cpu_kernels import ops as kernel_ops
from srt.layers.cpu_kernels.build import load_library
from srt.layers.cpu_kernels.checks import index_error
from srt.utils.sync_guard import HostSyncError, forbid_host_sync

aten = torch.ops.aten

# Ops whose result is fresh memory of no defined content: the captured tensor is the buffer.
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided}
_ALLOCATIONS |= {aten.new_empty_strided}
# Ops whose answer is a host value, or whose tensor is made of host values (``torch.tensor``
# of a list): a replay would keep the capture's.
_HOST_VALUES = {aten._local_scalar_dense, aten.item, aten.equal, aten.is_nonzero}
_HOST_VALUES |= {aten.lift_fresh}


class CpuGraphError(RuntimeError):
    """The forward did something a replay could not repeat."""


class CpuGraph:
    """One captured forward (``capture``) and its replay (``replay``)."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], Any]] = []
        self._keep: list[Any] = []  # every tensor the steps' arguments point into
        self._output: Any = None
        self._lib: ctypes.CDLL | None = None
        self._program: list[int] = []  # the kernel calls since the last step, as srt_run's words
        self._calls: list[str] = []  # their ops' names

    def capture(self, run: Callable[[], Any]) -> Any:
        """Runs ``run`` once, recording it; returns its output, which every replay rewrites."""
        if kernel_ops.recorder is not None:
            raise CpuGraphError("a CPU graph is already being captured")
        self._lib = load_library()
        kernel_ops.recorder = self
        self._keep.append(kernel_ops.work_buffer_in_use())
        try:
            with forbid_host_sync(), _OpRecorder(self):
                self._output = run()
            self._end_program()
        except HostSyncError as e:
            raise CpuGraphError(str(e)) from e
        finally:
            kernel_ops.recorder = None
        return self._output

    def replay(self) -> Any:
        for step in self._steps:
            step()
        return self._output

    # --- recording ---------------------------------------------------------------------------

    def library(self, lib: ctypes.CDLL) -> _RecordingLibrary:
        """The kernels' library as the ops see it while this graph is captured."""
        self._lib = lib
        return _RecordingLibrary(lib, self)

    def _add_kernel_call(self, name: str, function, args: tuple) -> Any:
        result = function(*args)
        if function.restype is ctypes.c_int and result:
            return result  # refused, wrote nothing: the op raises (rope grows its table, retries)
        self._add_call(name, list(map(_word, function.argtypes, args)))
        return result

    def _add_call(self, name: str, words: list[int]) -> None:
        count = ctypes.c_int64()
        op = self._lib.srt_program_op(name.encode(), ctypes.byref(count))
        if op < 0 or count.value != len(words):
            raise CpuGraphError(f"{name} cannot be called from a program")
        self._program += [op, *words]
        self._calls.append(name.removeprefix("srt_"))

    def _add_in_c(self, packet, args: tuple, out: Any) -> bool:
        """A cast between float32 and bf16, or an embedding's gather, as a program's call
        (``csrc/cpu_program.c``): run as torch ops, each costs tens of µs in a decode step, its
        code and data cold after the weights' streaming. Whether the op was taken so."""
        if self._lib is None or not isinstance(out, torch.Tensor) or not out.is_contiguous():
            return False
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_cpu or not x.is_contiguous():
            return False
        types = cpu_kernels.ACT_TYPES
        if packet in (aten.to, aten._to_copy) and x.dtype in types and out.dtype in types:
            same = x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            if x.numel() != out.numel() or same:
                return False
            words = [types[x.dtype], x.data_ptr(), x.numel(), types[out.dtype], out.data_ptr()]
            self._add_call("convert", words)
            return True
        index = args[1] if len(args) > 1 else None
        if packet is aten.embedding and x.dim() == 2 and isinstance(index, torch.Tensor):
            if index.dtype != torch.int64 or not index.is_contiguous():
                return False
            row = x.shape[1] * x.element_size()
            words = [x.data_ptr(), x.shape[0], row, index.data_ptr(), index.numel(), out.data_ptr()]
            self._add_call("gather_rows", words)
            return True
        return False

    def _end_program(self) -> None:
        """The kernel calls since the last step as one step, run by the library."""
        if not self._calls:
            return
        program = torch.tensor(self._program, dtype=torch.int64)
        run, calls, failed = self._lib.srt_run, self._calls, ctypes.c_int64()
        address, length, where = program.data_ptr(), program.numel(), ctypes.byref(failed)
        self._keep.append(program)
        self._program, self._calls = [], []

        def step() -> None:
            status = run(address, length, where)
            if status:
                raise index_error(calls[failed.value], status)

        self._steps.append(step)

    def _add_step(self, step: Callable[[], Any]) -> None:
        self._end_program()
        self._steps.append(step)

    def _add_op(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        self._keep.append((args, kwargs, out))
        packet = func.overloadpacket
        if packet in _HOST_VALUES:
            raise CpuGraphError(f"{func}: a value on the host, which a replay would not renew")
        if packet in _ALLOCATIONS or self._add_in_c(packet, args, out):
            return
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self._add_step(lambda: func(*args, **kwargs))
        elif _is_view_of(out, args, kwargs):
            return  # a view of tensors the graph keeps
        elif isinstance(out, torch.Tensor):
            self._add_step(lambda: out.copy_(func(*args, **kwargs)))
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):

            def step() -> None:
                for captured, new in zip(out, func(*args, **kwargs)):
                    captured.copy_(new)

            self._add_step(step)
        else:
            raise CpuGraphError(f"{func} returns {type(out).__name__}, which a replay cannot hold")


def _word(kind, value) -> int:
    """A kernel argument as srt_run's 64-bit word: a float's bits, an address (0 for None), an
    integer."""
    if kind is ctypes.c_float:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    return 0 if value is None else int(value)


def _storages(values) -> set[int]:
    return {
        v.untyped_storage().data_ptr()
        for v in values
        if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes()
    }


def _is_view_of(out: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``out`` only shows memory of the op's arguments (``view``; ``reshape`` and ``to``
    where they did not copy), so that replaying the op would change nothing."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        return False
    inputs = _storages([*args, *kwargs.values()])
    return all(not t.numel() or t.untyped_storage().data_ptr() in inputs for t in outs)


class LazyCpuGraph:
    """A CpuGraph of ``run``, captured by its first call (whose forward is the capture, so a
    bucket that never decodes costs nothing) and replayed by the next ones."""

    def __init__(self, run: Callable[[], Any]):
        self._run, self._graph = run, None

    def __call__(self) -> Any:
        if self._graph is not None:
            return self._graph.replay()
        graph = CpuGraph()
        out = graph.capture(self._run)
        self._graph = graph
        return out


class _RecordingLibrary:
    """The C library's functions, each call run and recorded."""

    def __init__(self, lib: ctypes.CDLL, graph: CpuGraph):
        self._lib, self._graph = lib, graph

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._lib, name)
        if not callable(function):
            return function
        return lambda *args: self._graph._add_kernel_call(name, function, args)


class _OpRecorder(TorchDispatchMode):
    def __init__(self, graph: CpuGraph):
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled: without this, the mode's first op imports Dynamo (and
        # Triton, which then reports leaks at the process's exit).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph._add_op(func, args, kwargs, out)
        return out
