"""The CPU kernels' boundary (``srt.layers.cpu_kernels``): every op refuses a bad argument with
a ``ValueError`` naming the op and the argument, before any C code runs (metadata checks) or
before the kernel writes anything (its index checks); the ops are ``srt::`` torch ops that the
profiler names and ``torch.compile`` traces without graph breaks; the header declares what
Python calls; concurrent loads on an empty cache compile once, and a build keeps the cache
folder clean."""

from __future__ import annotations

import ctypes
import multiprocessing
import re
import stat

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.cpu_kernels import attention_ops, build, ops
from srt.layers.moe.topk import TopKConfig

if not cpu_kernels.available():  # the cases below pack weights for the kernels' panels
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)
SLOTS = 64


def _linear_args(rows=3, k=16, n=40):
    return torch.randn(rows, k), cpu_kernels.pack_panels(torch.randn(n, k)), n


def _experts_args(tokens=4, hidden=None, inter=None, experts=3):
    p = cpu_kernels.panel_width()
    hidden, inter = hidden or p, inter or p
    w13 = cpu_kernels.pack_panels(torch.randn(experts, 2 * inter, hidden))
    w2 = cpu_kernels.pack_panels(torch.randn(experts, hidden, inter))
    ids = torch.randint(0, experts, (tokens, 2))
    return torch.randn(tokens, hidden), torch.rand(tokens, 2), ids, 0, w13, w2


def _cache(heads=4, kv_heads=2, dim=16):
    k_buf, v_buf = torch.randn(SLOTS, kv_heads, dim), torch.randn(SLOTS, kv_heads, dim)
    table = torch.randint(0, SLOTS, (3, 10))
    return torch.randn(2, heads, dim), k_buf, v_buf, table


def _decode_args(**changes):
    q, k_buf, v_buf, table = _cache()
    args = dict(q=q, k_buf=k_buf, v_buf=v_buf, req_to_token=table,
                req_pool_indices=torch.tensor([0, 2]), seq_lens=torch.tensor([3, 10]),
                scale=0.25)  # fmt: skip
    return {**args, **changes}


def _extend_args(**changes):
    q, k_buf, v_buf, table = _cache()
    q = torch.randn(5, 4, 16)  # sequence 0: 2 new tokens after 3; sequence 1: 3 new, no prefix
    seqs = torch.tensor([[0, 2], [3, 0], [2, 3], [0, 2]])
    args = dict(q=q, k_buf=k_buf, v_buf=v_buf, req_to_token=table, seqs=seqs, scale=0.25)
    return {**args, **changes}


def _rope_args(**changes):
    args = dict(x=torch.randn(3, 2, 8), positions=torch.tensor([0, 5, 2]),
                cos_sin=torch.randn(16, 8), neox=True)  # fmt: skip
    return {**args, **changes}


def _store_args(**changes):
    k_cache, v_cache = torch.zeros(SLOTS, 2, 16), torch.zeros(SLOTS, 2, 16)
    args = dict(k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16), loc=torch.tensor([4, 0, 9]),
                k_cache=k_cache, v_cache=v_cache)  # fmt: skip
    return {**args, **changes}


_TOPK = TopKConfig(2, renormalize=True)


def _route_args(**changes):
    args = dict(logits=torch.randn(3, 8), top_k=2, sigmoid=False, renormalize=True, groups=0,
                topk_group=0, scaling=1.0)  # fmt: skip
    return {**args, **changes}


def _with(args: tuple, i: int, value) -> tuple:
    return (*args[:i], value, *args[i + 1 :])


_q, _k, _v, _table = _cache()
_lin = _linear_args()
_exp = _experts_args()
# (op, arguments, the argument the error must name); metadata checks, which run before C.
METADATA_CASES = [
    ("panel_linear", _with(_lin, 0, torch.randn(3, 17)), "x has columns 17"),
    ("panel_linear", _with(_lin, 0, torch.randn(3, 16).double()), "x has dtype torch.float64"),
    ("panel_linear", _with(_lin, 1, _lin[1].repeat(1, 1, 2)[..., ::2]), "panels must be contig"),
    ("panel_linear", _with(_lin, 2, 200), "out_features 200 is outside"),
    ("fused_experts", _with(_exp, 2, _exp[2][:, :1].contiguous()), "topk_ids .* disagree"),
    ("fused_experts", _with(_exp, 2, _exp[2].int()), "topk_ids must be a 2-d torch.int64"),
    ("fused_experts", _with(_exp, 0, torch.randn(4, 2 * _exp[0].shape[1])), "w13_panels has rows"),
    ("fused_experts", _with(_exp, 5, _exp[5][:2]), "w13_panels has experts 3, expected 2"),
    ("fused_experts", _with(_exp, 3, -1), "start -1 is negative"),
    ("rms_norm", (torch.randn(2, 8), torch.ones(7), 1e-6), "weight has size 7"),
    ("rms_norm", (torch.randn(2, 8), torch.ones(8), -1.0), "eps -1.0 is not"),
    ("rms_norm", (torch.randn(2, 8).half(), torch.ones(8).half(), 1e-6), "x has dtype torch.fl"),
    ("rms_norm", (torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6), "weight must be a 1-d"),
    ("fused_add_rms_norm", (torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6),
     "residual .* is not x's"),
    ("decode_attention", _decode_args(q=torch.randn(2, 3, 16)), "q has 3 heads, not a multiple"),
    ("decode_attention", _decode_args(seq_lens=torch.tensor([3])), "seq_lens has length 1"),
    ("decode_attention", _decode_args(req_pool_indices=torch.tensor([0, 1, 2])),
     "req_pool_indices has length 3"),
    ("decode_attention", _decode_args(req_to_token=_table.int()), "req_to_token must be"),
    ("decode_attention", _decode_args(k_buf=_k[..., :8]), "k_buf has head dim 8"),
    ("decode_attention", _decode_args(v_buf=torch.randn(SLOTS, 1, 16)), "k_buf has heads 2"),
    ("extend_attention", _extend_args(seqs=torch.zeros(3, 2).long()), "seqs has rows 3"),
    ("extend_attention", _extend_args(q=torch.randn(5, 4, 8)), "k_buf has head dim 16"),
    ("rope", _rope_args(positions=torch.tensor([0, 1])), "positions has length 2"),
    ("rope", _rope_args(cos_sin=torch.randn(16, 6)), "cos_sin has columns 6"),
    ("rope", _rope_args(x=torch.randn(3, 2, 7), cos_sin=torch.randn(16, 7)), "x has an odd rota"),
    ("store_kv", _store_args(loc=torch.tensor([4, 0])), "k has tokens 3, expected 2"),
    ("store_kv", _store_args(v_cache=None), "v and v_cache must be given together"),
    ("store_kv", _store_args(k=torch.randn(3, 2, 16).bfloat16()), "k_cache must be a 3-d"),
    ("store_kv", _store_args(v_cache=torch.zeros(SLOTS, 2, 8)), "v rows \\(2, 16\\) are not"),
    ("select_experts", _route_args(top_k=9), "top_k 9 is outside \\[1, 8\\]"),
    ("select_experts", _route_args(groups=3, topk_group=1), "groups 3 .* do not split 8"),
    ("select_experts", _route_args(groups=4, topk_group=1, top_k=3), "top_k 3 is outside"),
    ("select_experts", _route_args(bias=torch.zeros(7)), "bias has length 7"),
    ("select_experts", _route_args(counts=torch.zeros(8)), "counts must be a 1-d torch.int64"),
]  # fmt: skip


class _NoKernels:
    """A library whose kernels must not be called: only the panel width may be read."""

    def __init__(self, width: int):
        self.panel_width = width

    def __getattr__(self, name):
        raise AssertionError(f"{name} ran although its arguments were refused")


def _call(op: str, args):
    impl = getattr(ops, f"_{op}", None) or getattr(attention_ops, f"_{op}")
    return impl(**args) if isinstance(args, dict) else impl(*args)


@pytest.mark.parametrize("op,args,message", METADATA_CASES)
def test_metadata_checks_refuse_before_the_kernel_runs(monkeypatch, op, args, message):
    no_kernels = _NoKernels(cpu_kernels.panel_width())
    monkeypatch.setattr(ops, "_lib", lambda: no_kernels)
    with pytest.raises(ValueError, match=f"srt::{op}: {message}"):
        _call(op, args)


# The kernels' own index checks: (op, arguments, message); each checked before any write.
INDEX_CASES = [
    ("decode_attention", _decode_args(req_pool_indices=torch.tensor([0, 3])),
     "req_pool_indices holds a row outside"),
    ("decode_attention", _decode_args(req_pool_indices=torch.tensor([-1, 0])),
     "req_pool_indices holds a row outside"),
    ("decode_attention", _decode_args(seq_lens=torch.tensor([3, 11])), "seq_lens holds a length"),
    ("decode_attention", _decode_args(seq_lens=torch.tensor([0, 2])), "seq_lens holds a length"),
    ("decode_attention", _decode_args(req_to_token=torch.full((3, 10), SLOTS)),
     "req_to_token holds a slot outside"),
    ("decode_attention", _decode_args(v_buf=_v[:8]), "req_to_token holds a slot outside"),
    ("extend_attention", _extend_args(seqs=torch.tensor([[0, 3], [3, 0], [2, 3], [0, 2]])),
     "seqs holds a row outside"),
    ("extend_attention", _extend_args(seqs=torch.tensor([[0, 2], [9, 0], [2, 3], [0, 2]])),
     "seqs holds a prefix"),
    ("extend_attention", _extend_args(seqs=torch.tensor([[0, 2], [3, 0], [2, 3], [0, 3]])),
     "seqs places a sequence's queries outside"),
    ("extend_attention", _extend_args(req_to_token=torch.full((3, 10), -1)),
     "req_to_token holds a slot outside"),
    ("rope", _rope_args(positions=torch.tensor([0, 16, 1])), "positions holds a position"),
    ("store_kv", _store_args(loc=torch.tensor([4, SLOTS, 9])), "loc holds a slot outside"),
    ("store_kv", _store_args(loc=torch.tensor([-1, 0, 9])), "loc holds a slot outside"),
]  # fmt: skip


@pytest.mark.parametrize("op,args,message", INDEX_CASES)
def test_index_checks_in_c_refuse(op, args, message):
    caches = [t.clone() for t in args.values() if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match=f"srt::{op}: {message}"):
        _call(op, args)
    after = [t for t in args.values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(caches, after))  # nothing written


def test_a_position_past_the_table_is_its_own_error():
    with pytest.raises(cpu_kernels.PositionOutsideTable):
        cpu_kernels.rope(**_rope_args(positions=torch.tensor([0, 16, 1])))


def _every_op(x, panels, norm_weight, q, k_buf, v_buf, table, rows, lens, seqs, pos, cos_sin):
    hidden = cpu_kernels.panel_linear(x, panels)
    normed, total = cpu_kernels.rms_norm(hidden, norm_weight, 1e-6, residual=hidden)
    experts = cpu_kernels.fused_experts(normed, *_EXPERTS)
    decode = cpu_kernels.decode_attention(q, k_buf, v_buf, table, rows, lens, 0.25)
    extend = cpu_kernels.extend_attention(q, k_buf, v_buf, table, seqs, 0.25)
    rotated = cpu_kernels.rope(q, pos, cos_sin, True)
    counts = torch.zeros(q.shape[2], dtype=torch.int64)
    weights, ids = cpu_kernels.select_experts(rotated[:, 0], _TOPK, None, (counts,))
    k_cache = torch.zeros_like(k_buf)
    cpu_kernels.store_kv(rotated[:, :2], None, pos, k_cache, None)
    return (cpu_kernels.rms_norm(experts + total, norm_weight, 1e-6), decode, extend, rotated,
            weights, ids, counts, k_cache)  # fmt: skip


_EXPERTS = _experts_args(tokens=2)[1:]


def _every_op_args():
    p = cpu_kernels.panel_width()
    q, k_buf, v_buf, table = _cache()
    seqs = torch.tensor([[0, 2], [3, 0], [1, 1], [0, 1]])
    return (torch.randn(2, 24), cpu_kernels.pack_panels(torch.randn(p, 24)), torch.rand(p), q,
            k_buf, v_buf, table, torch.tensor([0, 2]), torch.tensor([4, 10]), seqs,
            torch.tensor([3, 7]), torch.randn(16, 16))  # fmt: skip


def test_ops_trace_under_torch_compile_without_graph_breaks():
    torch._dynamo.reset()
    args = _every_op_args()
    compiled = torch.compile(_every_op, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(*args), _every_op(*args)):
        assert torch.equal(got, expected)


def test_ops_have_schemas_and_profiler_names():
    schema = str(torch.ops.srt.rms_norm.default._schema)
    assert schema == "srt::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"
    args = _every_op_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _every_op(*args)
    names = {event.key for event in prof.key_averages()}
    for op in ("panel_linear", "rms_norm", "fused_add_rms_norm", "fused_experts", "rope",
               "decode_attention", "extend_attention", "select_experts", "store_kv"):  # fmt: skip
        assert f"srt::{op}" in names


_CTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def _prototypes(header: str) -> dict[str, tuple]:
    """The header's prototypes of srt_* functions, as ctypes types."""
    found = {}
    for result, name, params in re.findall(r"^(\w+) (srt_\w+)\(([^)]*)\);", header, re.M):
        types = [] if params.strip() == "void" else [
            ctypes.c_void_p if "*" in p else _CTYPES[p.split()[0]] for p in params.split(",")
        ]  # fmt: skip
        found[name] = (_CTYPES[result], types)
    return found


def test_header_declares_what_python_calls():
    assert _prototypes(build.HEADER.read_text()) == build.DECLARATIONS


def _compiler_that_counts(tmp_path, fail: bool = False):
    """A C compiler that logs every build (not ``--version``) and then builds, or fails
    after writing half an output file."""
    log, cc = tmp_path / "builds.log", tmp_path / "cc"
    build_step = 'touch "${@: -2:1}"; exit 1' if fail else 'exec cc "$@"'
    cc.write_text(
        f'#!/bin/bash\n[ "$1" = --version ] && exec cc "$@"\necho built >> {log}\n{build_step}\n'
    )
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    return cc, log


def _load_after(barrier) -> None:
    barrier.wait()
    build.load_library.cache_clear()
    raise SystemExit(0 if build.load_library() is not None else 1)


def test_eight_processes_on_an_empty_cache_compile_once(monkeypatch, tmp_path):
    cc, log = _compiler_that_counts(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = build.cache_dir()
    folder.mkdir(parents=True)
    stale = [folder / "cpu_kernels-0123456789ab-0123456789ab.so", folder / ".x.so.99.tmp"]
    for path in stale:
        path.write_bytes(b"old")
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(8)
    processes = [context.Process(target=_load_after, args=(barrier,)) for _ in range(8)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * 8
    assert log.read_text().count("built") == 1
    assert sorted(p.name for p in folder.iterdir()) == ["build.lock", build.build_name(str(cc))]


def test_a_failed_build_leaves_no_file_and_keeps_pytorch(monkeypatch, tmp_path):
    cc, log = _compiler_that_counts(tmp_path, fail=True)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    build.load_library.cache_clear()
    try:
        assert build.load_library() is None
    finally:
        build.load_library.cache_clear()
    assert log.read_text().count("built") == 1
    assert [p.name for p in build.cache_dir().iterdir()] == ["build.lock"]
