#!/usr/bin/env bash
# A trimmed llama.cpp source tree for the CUDA build of llama-bench / llama-batched-bench / llama-quantize and
# the HF -> GGUF converter, carried to the GPU machine (llama.cpp as the speed peer).
#
# Runs HERE (the machine with the sdist), from anywhere:
#   bash ci/llamacpp_src.sh /work/llama/llama_cpp_python-0.3.36.tar.gz
# It extracts vendor/llama.cpp from llama-cpp-python's source distribution, drops what those three tools and the
# converter do not need, and writes .llama-src/llama.cpp-src.tar.xz (git-ignored; tmp + rename), then prints its
# size and sha256. Then, on the device machine (carry [".llama-src", ".whl"]): see ci/gpu_llamacpp.sh.
#
# Kept: CMake files, cmake/, include/, src/ (every model, qwen4exp among them), common/, ggml/ with only the
# CPU and CUDA backends, vendor/{cpp-httplib,nlohmann,sheredom,hash,stb} (common links them), tools/llama-bench,
# tools/batched-bench, tools/quantize, convert_hf_to_gguf.py, conversion/, gguf-py/ (without its tests).
# Dropped: .git, models/ (vocab GGUFs), docs/, media/, benches/, tests/, examples/, pocs/, app/, scripts/,
# every other tool (server + its web UI, mtmd, cli, ...), vendor/miniaudio, the other ggml backends (vulkan,
# metal, sycl, cann, opencl, hexagon, webgpu, musa, hip, ...). An add_subdirectory() of a dropped folder is
# commented out (marked "trimmed by ci/llamacpp_src.sh") so the tree configures with the default options.
# TRIM.txt in the tree records the sdist's sha256, llama.cpp's commit and the list of dropped paths.
#
# CHECK=1 also configures the trimmed tree once without CUDA (cmake -G Ninja -DGGML_CUDA=OFF; no build) to show
# nothing needed was dropped (the CUDA configure needs the toolkit's cuBLAS, present only on the device).
set -euo pipefail
SDIST="${1:-/work/llama/llama_cpp_python-0.3.36.tar.gz}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.llama-src"
OUTF="$DEST/llama.cpp-src.tar.xz"
[ -f "$SDIST" ] || { echo "llamacpp_src: expected llama-cpp-python's source distribution (.tar.gz), found nothing at $SDIST" >&2; exit 2; }

work="$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-src.XXXXXX")"
trap 'rm -rf "$work"' EXIT
top="$(set +o pipefail; tar tzf "$SDIST" 2>/dev/null | head -n 1 | cut -d/ -f1)"  # head closes the pipe early
echo "llamacpp_src: extracting $top/vendor/llama.cpp from $SDIST"
tar xzf "$SDIST" -C "$work" "$top/vendor/llama.cpp" "$top/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null \
  || tar xzf "$SDIST" -C "$work" "$top/vendor/llama.cpp"
commit="$(cat "$work/$top/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)"
src="$work/llama.cpp"
mv "$work/$top/vendor/llama.cpp" "$src"
rm -rf "${work:?}/$top"
[ -f "$src/convert_hf_to_gguf.py" ] && [ -d "$src/ggml/src/ggml-cuda" ] && [ -f "$src/tools/llama-bench/llama-bench.cpp" ] \
  || { echo "llamacpp_src: expected vendor/llama.cpp with convert_hf_to_gguf.py, ggml-cuda and tools/llama-bench in $SDIST, found otherwise" >&2; exit 2; }
before=$(du -sk "$src" | cut -f1)

python3 - "$src" "$SDIST" "$commit" <<'PY'
import hashlib, os, re, shutil, sys
from pathlib import Path
src, sdist, commit = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
KEEP_TOP = {"CMakeLists.txt", "CMakePresets.json", "LICENSE", "cmake", "include", "src", "common", "ggml", "vendor",
            "tools", "licenses", "convert_hf_to_gguf.py", "conversion", "gguf-py", "pyproject.toml", "requirements",
            "requirements.txt", "README.md"}
KEEP_TOOLS = {"CMakeLists.txt", "llama-bench", "batched-bench", "quantize"}
KEEP_GGML_SRC_DIRS = {"ggml-cpu", "ggml-cuda"}
DROP_VENDOR = {"miniaudio"}
dropped = []

def drop(p: Path):
    dropped.append(str(p.relative_to(src)))
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

for p in sorted(src.iterdir()):
    if p.name not in KEEP_TOP:
        drop(p)
for p in sorted((src / "tools").iterdir()):
    if p.name not in KEEP_TOOLS:
        drop(p)
for p in sorted((src / "ggml" / "src").iterdir()):
    if p.is_dir() and p.name not in KEEP_GGML_SRC_DIRS:
        drop(p)
for p in sorted((src / "vendor").iterdir()):
    if p.name in DROP_VENDOR:
        drop(p)
for p in (src / "gguf-py" / "tests", src / "ggml" / "src" / "ggml-cpu" / "kleidiai",
          src / "ggml" / "src" / "ggml-cpu" / "spacemit"):
    if p.exists():
        # kleidiai / spacemit: Arm / RISC-V vendor kernels, built only with GGML_CPU_KLEIDIAI / GGML_CPU_RISCV64_SPACEMIT
        drop(p)
for p in list(src.rglob("*")):
    if p.is_file() and (p.suffix in (".gguf", ".png", ".jpg", ".gif", ".mp3", ".wav") or p.name == ".DS_Store"):
        drop(p)

# an add_subdirectory() of a dropped folder would stop the configure: comment it out, marked
pat = re.compile(r"^(\s*)add_subdirectory\(\s*([A-Za-z0-9_./-]+)\s*\)", re.M)
patched = []
for cm in src.rglob("CMakeLists.txt"):
    text = cm.read_text(encoding="utf-8")
    def sub(m):
        if (cm.parent / m.group(2)).is_dir():
            return m.group(0)
        patched.append(f"{cm.relative_to(src)}: {m.group(2)}")
        return f"{m.group(1)}# add_subdirectory({m.group(2)})  # trimmed by ci/llamacpp_src.sh"
    new = pat.sub(sub, text)
    if new != text:
        cm.write_text(new, encoding="utf-8")
h = hashlib.sha256()
with open(sdist, "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
(src / "LLAMACPP_COMMIT").write_text(commit + "\n")
(src / "TRIM.txt").write_text(
    f"trimmed by ci/llamacpp_src.sh from {os.path.basename(sdist)} (sha256 {h.hexdigest()})\n"
    f"llama.cpp commit {commit}\n\nadd_subdirectory() commented out:\n" + "".join(f"  {x}\n" for x in patched)
    + "\ndropped:\n" + "".join(f"  {x}\n" for x in dropped), encoding="utf-8")
print(f"llamacpp_src: dropped {len(dropped)} paths, commented out {len(patched)} add_subdirectory() lines")
PY
after=$(du -sk "$src" | cut -f1)
echo "llamacpp_src: tree $((before / 1024)) MiB -> $((after / 1024)) MiB (llama.cpp commit $commit)"

if [ "${CHECK:-0}" != 0 ]; then
  echo "llamacpp_src: CHECK=1: configuring the trimmed tree without CUDA (no build)"
  cmake -S "$src" -B "$work/build" -G Ninja -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_OPENSSL=OFF > "$work/configure.log" 2>&1 \
    || { tail -n 30 "$work/configure.log" >&2; echo "llamacpp_src: the trimmed tree does not configure" >&2; exit 1; }
  grep -E "^-- (Including|Configuring done|Generating done)" "$work/configure.log" || true
  rm -rf "$work/build"
fi

mkdir -p "$DEST"
tmp="$(mktemp "$DEST/.llama.cpp-src.tar.xz.XXXXXX")"
trap 'rm -rf "$work" "$tmp"' EXIT
tar -C "$work" --owner=0 --group=0 --sort=name -cf - llama.cpp | xz -T2 -6 > "$tmp"
chmod 644 "$tmp"  # mktemp makes it 0600
mv -f "$tmp" "$OUTF"
size=$(stat -c %s "$OUTF")
echo "llamacpp_src: wrote $OUTF: $((size / 1024)) KiB ($size bytes)"
echo "llamacpp_src: sha256 $(sha256sum "$OUTF" | cut -d' ' -f1)"
[ "$size" -lt $((20 * 1024 * 1024)) ] || { echo "llamacpp_src: expected < 20 MiB, found $size bytes" >&2; exit 1; }
