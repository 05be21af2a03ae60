#!/usr/bin/env bash
# Run the GPU-only tests (marked `gpu`) on a machine with an NVIDIA GPU and a CUDA torch.
# Usage: scripts/gpu_tests.sh   (from the repository root, in an environment with m2flow
# installed: pip install -e ".[test]" without constraints.txt keeps the CUDA torch you have).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: these tests need an NVIDIA GPU")
print("GPU:", torch.cuda.get_device_name(0))
try:  # tests/test_vllm_engine.py's sleep/wake test needs the CUDA vllm wheel
    import vllm
    print("vllm:", vllm.__version__)
except ImportError as exc:
    print(f"vllm not importable ({exc}): the vLLM sleep/wake test will be SKIPPED; "
          "pip install vllm for it", file=sys.stderr)
PY
python -m pytest -m gpu -q -rs tests/ "$@"
