"""``prepare_for_cpu(model)`` reaches every module that declares the work (``CpuPreparable``)
and only those: the linear layer gets its packed weight, RMSNorm and the rotary embedding
their C kernels."""

from __future__ import annotations

import pytest
from torch import nn

from srt.layers import cpu_kernels
from srt.layers.cpu_preparation import CpuPreparable, prepare_for_cpu
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ReplicatedLinear
from srt.layers.rotary_embedding import RotaryEmbedding


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
def test_prepare_for_cpu_reaches_every_preparable_module():
    linear, norm = ReplicatedLinear(16, 8), RMSNorm(16)
    nn.init.normal_(linear.weight)
    rope = RotaryEmbedding(8, 64, None)
    model = nn.ModuleDict({"block": nn.Sequential(norm, linear, nn.ReLU()), "rope": rope})
    preparable = [m for m in model.modules() if isinstance(m, CpuPreparable)]
    assert preparable == [norm, linear, rope]
    prepare_for_cpu(model)
    assert linear.packed_weight is not None
    assert norm.in_kernel and rope.cos_sin_table is not None
