"""Every engine CUDA source compiles with nvcc for Hopper (sm_90) and GB10 (sm_121).

NVRTC (cupy.RawModule) compiles them at run time on the GPU present; this test checks, without a GPU,
that the same sources are valid CUDA C++ for both target architectures. Skips with a reason when nvcc
is absent. A negative control checks that a broken source is reported (so a silently skipped compile
cannot pass).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from engine.backend import CUDA_DIR

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)
ARCHS = ["sm_90", "sm_121"]
SOURCES = sorted(CUDA_DIR.glob("*.cu"))

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (CUDA toolkit absent): "
                                "kernel sources not compiled")


def _supported(arch: str) -> bool:
    out = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return arch.replace("sm_", "compute_") in out


def _compile(src: Path, arch: str, tmp_path: Path) -> subprocess.CompletedProcess:
    obj = tmp_path / f"{src.stem}.{arch}.o"
    return subprocess.run([NVCC, "-c", "-std=c++17", f"--gpu-architecture={arch}", "-o", str(obj), str(src)],
                          capture_output=True, text=True, timeout=600)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_all_kernels_compile(arch, tmp_path):
    if not _supported(arch):
        pytest.skip(f"this nvcc cannot target {arch}")
    if not SOURCES:
        pytest.skip(f"no .cu sources in {CUDA_DIR} yet")
    failures = []
    for src in SOURCES:
        r = _compile(src, arch, tmp_path)
        if r.returncode != 0:
            failures.append(f"{src.name} [{arch}]:\n{r.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)


@needs_nvcc
def test_negative_control_broken_source_fails(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undeclared_symbol; }\n')
    r = _compile(bad, "sm_90", tmp_path)
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
