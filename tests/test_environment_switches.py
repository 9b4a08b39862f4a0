"""Every ``QWEN4EXP_*`` environment variable the code reads (product code, CI scripts and tests) is listed in
docs/environment.md's table, and the table lists nothing the code no longer reads."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWITCH = re.compile(r"\bQWEN4EXP_[A-Z0-9_]*[A-Z0-9]\b")
SOURCES = ("reference", "taps", "engine", "parity", "fixtures", "ci", ".ci", "tests")


def _read_by_code(root: Path = ROOT) -> dict[str, set[str]]:
    """Variable -> files mentioning it, over the source trees (.py, shell scripts, ci/gpu and .ci/run)."""
    out: dict[str, set[str]] = {}
    for top in SOURCES:
        for f in sorted((root / top).rglob("*")) if (root / top).is_dir() else []:
            if not f.is_file() or f.suffix not in (".py", ".sh", "") or "__pycache__" in f.parts:
                continue
            if f.resolve() == Path(__file__).resolve():
                continue  # this file's synthetic names
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for name in SWITCH.findall(text):
                out.setdefault(name, set()).add(str(f.relative_to(root)))
    return out


#: Switches the product no longer reads (their kernels are gone: one kernel per op). Named here only, so no other
#: file needs to spell them to hold them absent.
RETIRED = {
    "QWEN4EXP_SEQ_KERNELS": "the legacy QSA / GDN sequence kernels",
    "QWEN4EXP_MMA_GEMV": "the float32-FMA GEMV in place of the tensor-core one",
    "QWEN4EXP_QGEMV2": "the first qgemv_* quantised GEMV kernels",
    "QWEN4EXP_MOE_FUSED": "the unfused MoE decode chain (the fused chain is the only decode path)",
    "QWEN4EXP_MOE_EPILOGUES": "the GEMV-epilogue MoE decode chain",
    "QWEN4EXP_MOE_SHARED_STREAM": "the shared expert on a side stream (the decode block runs it in its own launches)",
}


def _table(doc: Path) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^\| `(QWEN4EXP_[A-Z0-9_]+)` \|", doc.read_text(encoding="utf-8"), re.M)}


def test_every_switch_the_code_reads_is_in_the_table():
    code, table = _read_by_code(), _table(ROOT / "docs" / "environment.md")
    code.pop("QWEN4EXP_", None)
    missing = {k: sorted(v) for k, v in code.items() if k not in table}
    assert not missing, f"switches missing from docs/environment.md: {missing}"
    stale = sorted(table - set(code))
    assert not stale, f"docs/environment.md lists switches no code reads: {stale}"


def test_the_check_sees_an_undocumented_switch(tmp_path):
    # negative control: a module reading a variable the table lacks is found
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text('import os\nFAST = os.environ.get("QWEN4EXP_NEW_PATH", "0")\n')
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "gpu").write_text('export QWEN4EXP_OTHER=1\n')
    doc = tmp_path / "env.md"
    doc.write_text("| `QWEN4EXP_OTHER` | `1` | ci | x |\n")
    code = _read_by_code(tmp_path)
    assert set(code) == {"QWEN4EXP_NEW_PATH", "QWEN4EXP_OTHER"}
    assert set(code) - _table(doc) == {"QWEN4EXP_NEW_PATH"}


def test_retired_switches_are_read_nowhere_and_not_documented():
    code, table = _read_by_code(), _table(ROOT / "docs" / "environment.md")
    still = {k: sorted(code[k]) for k in RETIRED if k in code}
    assert not still, f"retired switches still named in code: {still}"
    assert not set(RETIRED) & table, f"docs/environment.md lists retired switches: {sorted(set(RETIRED) & table)}"


def test_the_check_sees_a_retired_switch_coming_back(tmp_path):
    # negative control: a module reading a retired switch again is found by the scan the test above relies on
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "y.py").write_text('import os\nOLD = os.environ.get("QWEN4EXP_MOE_FUSED", "0")\n')
    assert set(_read_by_code(tmp_path)) & set(RETIRED) == {"QWEN4EXP_MOE_FUSED"}
