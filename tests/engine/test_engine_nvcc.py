"""Every engine CUDA source compiles with nvcc for Hopper (sm_90) and GB10 (sm_121).

NVRTC (cupy.RawModule) compiles them at run time on the GPU present; this test checks, without a GPU,
that the same sources are valid CUDA C++ for both target architectures. Like NVRTC, nvcc compiles the
device code only (``-cubin``: front end, PTX and ptxas for the arch; no host compiler), one test per
source and arch so that pytest-xdist spreads them and each has its own bound. Marked ``nvcc``: skipped
with the reason when nvcc is absent. A negative control checks that a broken source is reported (so a
silently skipped compile cannot pass).
"""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from engine.backend import CUDA_DIR

ARCHS = ["sm_90", "sm_121"]
SOURCES = sorted(CUDA_DIR.glob("*.cu"))

# One device compile of the largest source (quant_linear.cu, its nvcc-only template instantiations) takes
# about 30 s of CPU for one arch; 900 s leaves a 30x margin for a machine whose cores are shared.
COMPILE_TIMEOUT_S = 900


@functools.lru_cache(maxsize=None)
def _supported(nvcc: str, arch: str) -> bool:
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return arch.replace("sm_", "compute_") in out


def _compile(nvcc: str, src: Path, arch: str, tmp_path: Path) -> subprocess.CompletedProcess:
    obj = tmp_path / f"{src.stem}.{arch}.cubin"
    return subprocess.run([nvcc, "-cubin", "-std=c++17", f"--gpu-architecture={arch}", "-o", str(obj), str(src)],
                          capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)


def test_there_are_kernel_sources():
    assert SOURCES, f"no .cu sources in {CUDA_DIR}"


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_kernel_compiles(nvcc, src, arch, tmp_path):
    if not _supported(nvcc, arch):
        pytest.skip(f"this nvcc cannot target {arch}")
    r = _compile(nvcc, src, arch, tmp_path)
    assert r.returncode == 0, f"{src.name} [{arch}]:\n{r.stderr[-2000:]}"


@pytest.mark.nvcc
def test_negative_control_broken_source_fails(nvcc, tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undeclared_symbol; }\n')
    r = _compile(nvcc, bad, "sm_90", tmp_path)
    assert r.returncode != 0 and "undeclared_symbol" in r.stderr


def test_nvrtc_source_inlines_the_shared_header(tmp_path, monkeypatch):
    """NVRTC compiles engine.backend.cuda_source's text: every local header inlined once (so cupy's cache,
    keyed on the text, sees a header change); a missing header is an error naming it."""
    import engine.backend as B
    for src in SOURCES:
        text = B.cuda_source(src.name)
        assert B._LOCAL_INCLUDE.search(text) is None, src.name
        if '#include "common.cuh"' in src.read_text():
            assert text.count("float block_sum(") == 1 and "(inlined)" in text, src.name
    (tmp_path / "a.cu").write_text('#include "h.cuh"\n#include "h.cuh"\nK\n')
    (tmp_path / "h.cuh").write_text("#pragma once\nH\n")
    (tmp_path / "b.cu").write_text('#include "missing.cuh"\n')
    monkeypatch.setattr(B, "CUDA_DIR", tmp_path)
    assert B.cuda_source("a.cu").count("\nH\n") == 1
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        B.cuda_source("b.cu")


def kernels_without_grid_dep_entry(text: str) -> list[str]:
    """The kernels of CUDA source ``text`` whose body does not begin with ``GRID_DEP_ENTRY();``.

    engine.backend launches a captured step's kernels with programmatic dependent launch, so a kernel may be
    scheduled while the one before it still runs; only the entry's wait keeps its reads after that kernel's
    writes (grid_dep.cuh). A kernel body is the text after the first ``{`` following ``__global__`` (parameter
    lists and launch bounds hold no braces); a macro's line continuations are whitespace here.
    """
    import re
    missing = []
    for m in re.finditer(r"__global__", text):
        head_end = text.index("{", m.end())
        name = re.findall(r"([A-Za-z_][A-Za-z0-9_#]*)\s*\(", text[m.end():head_end])
        name = next((n for n in name if n != "__launch_bounds__"), "?")
        body = text[head_end + 1:].lstrip(" \t\\\n")
        if not body.startswith("GRID_DEP_ENTRY();"):
            missing.append(name)
    return missing


@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_every_kernel_waits_for_the_previous_one_first(src):
    text = src.read_text()
    assert '#include "grid_dep.cuh"' in text, f"{src.name}: does not include grid_dep.cuh"
    assert "__global__" in text
    assert kernels_without_grid_dep_entry(text) == [], f"{src.name}: kernels without GRID_DEP_ENTRY() first"
    # the text NVRTC compiles: a kernel defined in an included header is checked too
    import engine.backend as B
    assert kernels_without_grid_dep_entry(B.cuda_source(src.name)) == [], f"{src.name}: a header's kernel lacks it"


def test_negative_control_a_kernel_without_the_entry_is_named():
    text = ('extern "C" __global__ void __launch_bounds__(256) good(float* x) {\n    GRID_DEP_ENTRY();\n    x[0] = 1;\n}\n'
            '#define K(N) extern "C" __global__ void N(float* x) { GRID_DEP_ENTRY();  \\\n    x[0] = 2; }\n'
            'extern "C" __global__ void late(float* x) {\n    x[0] = 3;\n    GRID_DEP_ENTRY();\n}\n')
    assert kernels_without_grid_dep_entry(text) == ["late"]


def test_negative_control_a_header_kernel_without_the_entry_is_named(tmp_path, monkeypatch):
    import engine.backend as B
    (tmp_path / "a.cu").write_text('#include "grid_dep.cuh"\n#include "k.cuh"\n'
                                   'extern "C" __global__ void top(float* x) { GRID_DEP_ENTRY(); x[0] = 1; }\n')
    (tmp_path / "grid_dep.cuh").write_text((CUDA_DIR / "grid_dep.cuh").read_text())
    (tmp_path / "k.cuh").write_text('extern "C" __global__ void in_header(float* x) { x[0] = 2; }\n')
    monkeypatch.setattr(B, "CUDA_DIR", tmp_path)
    assert kernels_without_grid_dep_entry((tmp_path / "a.cu").read_text()) == []
    assert kernels_without_grid_dep_entry(B.cuda_source("a.cu")) == ["in_header"]
