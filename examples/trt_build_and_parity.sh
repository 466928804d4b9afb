#!/usr/bin/env bash
# Build TensorRT engines for a tiny model and prove they compute what PyTorch computes.
# Needs an NVIDIA GPU and TensorRT:  pip install -e '.[gpu]' --extra-index-url https://pypi.nvidia.com
# Usage: examples/trt_build_and_parity.sh [CHECKPOINT_DIR]   (default: the built-in tiny preset)
set -euo pipefail
work=$(mktemp -d -t tk-trt-XXXX)
ckpt=${1:-}
if [ -z "$ckpt" ]; then
  ckpt=$work/checkpoint
  python -c "from tk.models.fixtures.presets import write_preset; write_preset('tiny', '$ckpt')"
fi
tk doctor
tk export "$ckpt" -o "$work/artifact"
tk build-engine "$work/artifact" --max-batch 4 --max-input-len 64 --max-seq-len 128 --timing-cache "$work/timing.cache"
tk parity "$work/artifact" --backends torch,ort,trt --require trt --steps 16 --report "$work/parity.json"
tk generate "$work/artifact" --backend trt --prompt "Once upon a time" --max-new-tokens 24
echo "report: $work/parity.json"

# The static-capacity cache: TensorRT's in-place KV-cache update layer, from TensorScatter.
tk export "$ckpt" -o "$work/artifact-static" --kv-cache static --max-seq-len 128
tk build-engine "$work/artifact-static" --max-batch 4 --max-input-len 64 --timing-cache "$work/timing.cache"
tk parity "$work/artifact-static" --backends torch,ort,trt --require trt --steps 16
