"""--attention-backend: auto resolves per device (triton on CUDA where it imports, the cpu
backend on CPU where the C kernels build, else torch_native), and a named backend that cannot
run here is refused at start-up, naming the flag."""

from __future__ import annotations

import importlib.util

import pytest

from srt.layers import cpu_kernels
from srt.server_args import ServerArgs
from srt.server_args_checks import resolve_attention_backend


def _backend(**kwargs) -> str:
    return ServerArgs(model_path="m", **kwargs).attention_backend


@pytest.fixture
def kernels_off(monkeypatch):
    """The C kernels unavailable, as without a compiler (``SRT_CPU_KERNELS=0``)."""
    monkeypatch.setenv("SRT_CPU_KERNELS", "0")
    cpu_kernels.load_library.cache_clear()
    yield
    monkeypatch.delenv("SRT_CPU_KERNELS")
    cpu_kernels.load_library.cache_clear()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
def test_auto_on_cpu_is_the_cpu_backend_where_the_kernels_build():
    assert _backend(device="cpu") == "cpu"
    assert _backend(device="cpu", attention_backend="cpu") == "cpu"
    assert _backend(device="cpu", attention_backend="torch_native") == "torch_native"


def test_auto_on_cpu_without_the_kernels_is_torch_native(kernels_off):
    assert _backend(device="cpu") == "torch_native"
    with pytest.raises(ValueError, match="--attention-backend cpu: the CPU kernels are not built"):
        _backend(device="cpu", attention_backend="cpu")


def test_auto_on_cuda_is_triton_where_it_imports():
    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_attention_backend("auto", "cuda") == ("triton" if has_triton else "torch_native")
    assert resolve_attention_backend("torch_native", "cuda") == "torch_native"


def test_cpu_backend_refused_on_cuda():
    with pytest.raises(ValueError, match="--attention-backend cpu .* needs --device cpu"):
        resolve_attention_backend("cpu", "cuda")


def test_unknown_backend_refused():
    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        resolve_attention_backend("intel_amx", "cpu")
