# Sourced by ci/gpu and ci/gpu_bench.sh on the GPU machine (repo root): the official implementation there.
# The GPU image's transformers predates the specification (qwen4_exp of transformers >= 5.23); put the wheel in
# .whl/ beforehand (on a machine with PyPI access) and carry .whl to the GPU machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl transformers==5.24.0
# Its other needs (huggingface-hub>=1.31, tokenizers>=0.23.1,<0.24, safetensors>=0.8) are in the image.
# Without the wheel the official peer / the official-CUDA tests report themselves unavailable.
if [ -z "${QWEN4EXP_GPU_ENV:-}" ]; then
  export QWEN4EXP_GPU_ENV=1
  if ls .whl/transformers-*.whl >/dev/null 2>&1; then
    if "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
      export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "gpu_env: wheel install failed; the official peer will report itself unavailable" >&2
    fi
  else
    echo "gpu_env: no .whl/transformers-*.whl; the official peer will report itself unavailable" >&2
  fi
fi
