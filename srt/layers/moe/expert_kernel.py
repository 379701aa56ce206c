"""Which kernel runs the routed experts: one function of the device, the weights' dtype and
the shapes (``choose_expert_kernel``), asked by ``FusedMoE`` when it lays its weights out and
when it runs."""

from __future__ import annotations

import enum
import functools
import importlib.util

import torch

from srt.layers import cpu_kernels

# On CPU, experts whose gate/up weight is at least this large run one GEMM each (``LOOP``).
GROUPED_MAX_EXPERT_BYTES = 1 << 20


class ExpertKernel(str, enum.Enum):
    """How the routed experts run (``srt.layers.moe.expert_compute`` implements each)."""

    CPU_KERNEL = "cpu_kernel"  # the C kernel, both projections in one call (CPU)
    GROUPED_MM = "grouped_mm"  # torch's grouped GEMM, one call per projection
    TRITON = "triton"  # ``fused_moe_triton``, one launch per projection (CUDA)
    LOOP = "loop"  # one GEMM per expert, its rows read on the host


@functools.cache
def _has_grouped_mm(device: torch.device) -> bool:
    # torch's grouped GEMM kernels are built for sm90 and sm100; elsewhere it loops over the
    # groups reading their offsets on the host.
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] in (9, 10)


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _fits_cpu_kernel(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> bool:
    # The kernel reads whole panels of the gate, of the up and of the down projection.
    if not cpu_kernels.supports(device, dtype):
        return False
    return inter % cpu_kernels.panel_width() == 0 and hidden % cpu_kernels.panel_width() == 0


def choose_expert_kernel(
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
    intermediate_size: int,
    in_panels: bool = True,
) -> ExpertKernel:
    """The kernel for experts with weights of ``dtype`` on ``device`` (activations in the same
    dtype), ``w13`` [E, 2·I, H] and ``w2`` [E, H, I] (I: this rank's ``intermediate_size``).
    ``in_panels``: whether the weights are (or, asked before packing, may be) laid out in the
    C kernel's panels; weights left in torch's layout never take the C kernel.

    CPU: the C kernel (float32, bf16 or fp8 weights) where its panels fit; else torch's
    grouped GEMM (not for fp8, whose scales it cannot apply), for row
    strides that are multiples of 16 bytes and experts small enough that per-op overhead, not
    memory, bounds them; large experts see a few tokens each in decode, and the loop gives
    those oneDNN's kernel on packed weights (``srt.layers.linear.pack_weight``), which streams
    them several times faster.

    GPU: ``torch._grouped_mm`` takes bf16 on sm90 and sm100 (12× the loop on an H100 for one
    layer's gate/up, 512 rows × 128 experts); other dtypes and devices take the Triton kernel.
    Neither synchronises with the host."""
    align = 16 // dtype.itemsize
    aligned = hidden_size % align == 0 and intermediate_size % align == 0
    if device.type == "cuda":
        if aligned and dtype == torch.bfloat16 and _has_grouped_mm(device):
            return ExpertKernel.GROUPED_MM
        return ExpertKernel.TRITON if _has_triton() else ExpertKernel.LOOP
    if in_panels and _fits_cpu_kernel(device, dtype, hidden_size, intermediate_size):
        return ExpertKernel.CPU_KERNEL
    small = 2 * intermediate_size * hidden_size * dtype.itemsize < GROUPED_MAX_EXPERT_BYTES
    if hasattr(torch, "_grouped_mm") and aligned and small and dtype != torch.float8_e4m3fn:
        return ExpertKernel.GROUPED_MM
    return ExpertKernel.LOOP
