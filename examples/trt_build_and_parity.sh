#!/usr/bin/env bash
# Build TensorRT engines for a tiny model and prove they compute what PyTorch computes: the script a
# GPU machine runs first, on TensorRT 10.x (10.15+) or 11.x alike (every engine is strongly typed).
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
python -c "import tensorrt; print('TensorRT', tensorrt.__version__)"
cache=$work/timing.cache
limits=(--max-batch 4 --max-input-len 64)

# fp32 engines from fp32 graphs (TF32 off), dynamic cache; the timing cache and its record are written
tk export "$ckpt" -o "$work/fp32"
tk build-engine "$work/fp32" "${limits[@]}" --max-seq-len 128 --timing-cache "$cache"
grep -q '"tensorrt_version"' "$cache.json"
tk parity "$work/fp32" --backends torch,ort,trt --require trt --steps 16 --report "$work/parity-fp32.json"
tk generate "$work/fp32" --backend trt --prompt "Once upon a time" --max-new-tokens 24

# fp16 engines come from fp16 graphs; asking an fp32 artifact for fp16 is a usage error (exit 2)
set +e; tk build-engine "$work/fp32" --precision fp16 --force; rc=$?; set -e
[ "$rc" -eq 2 ] || { echo "expected exit 2 for --precision fp16 on fp32 graphs, got $rc"; exit 1; }
tk export "$ckpt" -o "$work/fp16" --dtype fp16
tk build-engine "$work/fp16" "${limits[@]}" --max-seq-len 128 --timing-cache "$cache"
tk parity "$work/fp16" --backends torch,ort,trt --require trt --steps 16

# The static cache: TensorScatter must become TensorRT's in-place KV-cache update layer (verbose log)
tk export "$ckpt" -o "$work/static" --kv-cache static --max-seq-len 128
tk build-engine "$work/static" "${limits[@]}" --timing-cache "$cache" --verbose 2> "$work/static-build.log"
grep -qiE "KVCacheUpdate|KV_CACHE_UPDATE" "$work/static-build.log" || { echo "no KVCacheUpdate layer in $work/static-build.log"; exit 1; }
tk parity "$work/static" --backends torch,ort,trt --require trt --steps 16

# Decomposable attention on fp32 (the case without a fused kernel): set in memory, the graph on disk unchanged
before=$(sha256sum "$work/fp32/decode.onnx")
tk build-engine "$work/fp32" "${limits[@]}" --max-seq-len 128 --decomposable-attention --force
[ "$(sha256sum "$work/fp32/decode.onnx")" = "$before" ] || { echo "the artifact's graph changed"; exit 1; }
tk parity "$work/fp32" --backends torch,ort,trt --require trt --steps 16

# A stale timing cache (its record names another TensorRT) is ignored with a note, never fed to the builder
python - "$cache.json" <<'PY'
import json, sys
record = json.load(open(sys.argv[1])); record["tensorrt_version"] = "0.0.0"; json.dump(record, open(sys.argv[1], "w"))
PY
tk build-engine "$work/fp32" "${limits[@]}" --max-seq-len 128 --timing-cache "$cache" --force 2> "$work/stale.log"
grep -q "ignoring timing cache" "$work/stale.log" || { echo "the stale timing cache was not ignored"; exit 1; }
echo "all TensorRT checks passed: $work"
