#!/usr/bin/env bash
# Build librmm_shim.so (RMM's pool and arena resources behind a C interface, for
# `compare --rmm`) on a machine with the CUDA toolkit:
#
#   bash benches/rmm/build.sh RMM_INCLUDE CCCL_ROOT OUT_DIR
#
# RMM_INCLUDE: RMM's cpp/include from a header-only release (25.06 or earlier: later ones
# are partly compiled). CCCL_ROOT: a CCCL checkout of the version that RMM release wants
# (2.8.x for 25.06), with libcudacxx/include, cub and thrust. Measured with RMM at
# dbd8cc7 and CCCL 2.8.6 (docs/BENCHMARKS.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rmm=$1; cccl=$2; out=$3
cuda=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$out"
"${CXX:-g++}" -std=c++17 -O2 -DNDEBUG -DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE -fPIC -shared \
  -I "$here/shim" -I "$cccl/libcudacxx/include" -I "$cccl/cub" -I "$cccl/thrust" -I "$rmm" -I "$cuda/include" \
  "$here/rmm_shim.cpp" -L "$cuda/lib64" -Wl,-rpath,"$cuda/lib64" -lcudart -o "$out/librmm_shim.so"
echo "built $out/librmm_shim.so"
