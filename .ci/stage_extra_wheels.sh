#!/usr/bin/env bash
# What the GPU sessions of issues 59-61 carry beyond ../shared/gpu/stage-wheels.sh's sets, in
# the git-ignored .whl/ (run from the repository root, after `stage-wheels.sh all`):
#   .whl/gdn: fla-core and einops (flash-linear-attention's kernels for the hybrid models),
#     installed into /tmp/site-gdn and put on PYTHONPATH by `source .whl/gdn/setup-device.sh`
#     (after the last p part);
#   the vllm set again with the CuTe DSL vLLM 0.26 pins (nvidia-cutlass-dsl 4.6.0: its Qwen3.5
#     prefill kernel), which the shared list leaves out: .whl/v1 .. .whl/v9.
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
shared=$(cd "$top/../shared/gpu" && pwd)
rm -rf .whl/gdn && mkdir -p .whl/gdn
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d .whl/gdn fla-core==0.6.0 einops==0.8.2
cat > .whl/gdn/setup-device.sh <<'SH'
# fla-core and einops into /tmp/site-gdn, on PYTHONPATH (source it after the last p part)
_g=$(dirname "${BASH_SOURCE[0]}")
if [ ! -f /tmp/site-gdn/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-gdn "$_g"/*.whl \
    && touch /tmp/site-gdn/.installed
fi
export PYTHONPATH=/tmp/site-gdn${PYTHONPATH:+:$PYTHONPATH}
true
SH
work=$(mktemp -d); cp "$shared"/* "$work"/
for w in nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
         nvidia-cutlass-dsl-libs-cu13; do
  echo "vllm  $w==4.6.0" >> "$work/device-wheels.txt"
done
bash "$work/stage-wheels.sh" vllm
rm -rf "$work"
