"""Building and loading the CPU kernels' shared library.

The C files in ``csrc/`` are compiled on first use with the machine's C compiler for the
machine's own instruction set, into a cache folder (``$XDG_CACHE_HOME/srt/kernels``, else
``~/.cache/srt/kernels``), under a name keyed by the source (first half) and by the compiler
and processor (second half). Ranks that start together take a file lock: one compiles, the
others wait and load its build. The compiler writes to a temporary file that is renamed into
place, and removed if the build fails; a build of other sources is removed once the current one
is in place, so the folder keeps one build per compiler and processor.

Where there is no compiler, the processor lacks AVX2 (x86 with AVX2 and FMA, or AVX-512, is
what the kernels' register blocks are sized for), or ``SRT_CPU_KERNELS=0`` is set,
``load_library`` returns None and the layers keep their PyTorch (oneDNN) paths;
``SRT_CPU_AMX=0`` keeps the bf16 GEMMs off AMX's tiles (``csrc/cpu_amx.c``). The kernels
run on a team of threads of their own (``csrc/cpu_pool.c``), as many as torch's intra-op
threads at each call; the library links OpenMP too (the runtime torch has already loaded),
for the extend attention and for a second caller while the team is busy.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_NAMES = ("cpu_kernels.c", "cpu_experts.c", "cpu_amx.c", "cpu_attention.c",
          "cpu_extend_attention.c", "cpu_pool.c", "cpu_router.c", "cpu_program.c")  # fmt: skip
SOURCES = [CSRC / name for name in _NAMES]
HEADER = CSRC / "cpu_kernels.h"
INCLUDED = [HEADER, CSRC / "cpu_fp8_dot.h"]  # every header the sources include
# -Werror=missing-prototypes: every exported function is declared in the header, so the
# compiler checks each definition against the prototype that DECLARATIONS is tested against.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
CFLAGS += ["-Wall", "-Werror=missing-prototypes"]

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# The exported functions as ctypes calls them: name → (result type, argument types), the
# arguments grouped as in the header's prototypes, which a test checks them against.
# fmt: off
DECLARATIONS: dict[str, tuple[type | None, list[type]]] = {
    "srt_panel_width": (_i64, []),
    "srt_kernel_is_fast": (_int, []),
    "srt_amx": (_int, [_int]),
    "srt_panel_linear": (
        None, [_int, _ptr, _i64, _i64, _int, _ptr, _ptr, _i64, _i64, _ptr, _ptr]
    ),
    "srt_fused_experts": (
        _int,
        [_int, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _ptr, _ptr, _i64,
         _ptr, _ptr, _i64, _ptr, _ptr],
    ),
    "srt_rms_norm": (None, [_int, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _f32, _ptr]),
    "srt_decode_attention": (
        _int,
        [_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr,
         _i64, _i64, _i64, _i64, _ptr, _ptr, _f32, _ptr],
    ),
    "srt_extend_attention": (
        _int,
        [_int, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr,
         _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr],
    ),
    "srt_rope": (_int, [_int, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int, _ptr]),
    "srt_select_experts": (
        None,
        [_int, _ptr, _i64, _i64, _i64, _ptr, _int, _i64, _i64, _i64, _int, _f32, _ptr, _ptr,
         _ptr, _ptr],
    ),
    "srt_store_kv": (
        _int, [_int, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64]
    ),
    "srt_program_op": (_i64, [_ptr, _ptr]),
    "srt_run": (_int, [_ptr, _i64, _ptr]),
}
# fmt: on


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "srt" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def build_name(compiler: str) -> str:
    """``cpu_kernels-<source key>-<compiler and processor key>.so``."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    source = _digest(*(f.read_text() for f in (*INCLUDED, *SOURCES)), " ".join(CFLAGS))
    return f"cpu_kernels-{source}-{_digest(version, _cpu_flags())}.so"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Holds the folder's build lock (an advisory ``flock``, released if the holder dies)."""
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile(compiler: str) -> Path:
    """The library's path, built first unless a build of these sources is cached."""
    folder = cache_dir()
    target = folder / build_name(compiler)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        if target.exists():  # built by the rank that held the lock before us
            return target
        tmp = folder / f".{target.name}.{os.getpid()}.tmp"
        logger.info("compiling the CPU kernels into %s", target)
        try:
            subprocess.run(
                [compiler, *CFLAGS, *map(str, SOURCES), "-o", str(tmp), "-lm"],
                capture_output=True,
                text=True,
                check=True,
            )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        _remove_stale(folder, keep=target.name)
    return target


def _remove_stale(folder: Path, keep: str) -> None:
    """Other sources' builds and temporary files that killed builds left behind (under the
    lock, so no build is in progress). Builds for another compiler or processor (a cache on a
    shared home folder) stay. A process that has a removed build loaded keeps its mapping."""
    source_key = keep.split("-")[1]
    for path in folder.iterdir():
        stale_build = path.suffix == ".so" and path.name.split("-")[1:2] != [source_key]
        if stale_build or path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (result, arguments) in DECLARATIONS.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = result, arguments
    lib.panel_width = lib.srt_panel_width()  # read on every call: kept rather than asked
    return lib


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, no compiler, no AVX2; logged once)."""
    if os.environ.get("SRT_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU kernels off, layers run in PyTorch")
        return None
    try:
        lib = _declare(ctypes.CDLL(str(_compile(compiler))))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("CPU kernels not built (%s): layers run in PyTorch", detail)
        return None
    if not lib.srt_kernel_is_fast():
        logger.info("no AVX2/AVX-512 on this CPU: CPU kernels off, layers run in PyTorch")
        return None
    if os.environ.get("SRT_CPU_AMX", "1") == "0":
        lib.srt_amx(0)
    return lib
