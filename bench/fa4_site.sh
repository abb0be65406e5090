#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute: CuTe DSL kernels, with Hopper ones) for the device machine, which has no
# internet. Here, in the repo root:   bash bench/fa4_site.sh
# downloads the wheels for its Python 3.12, unpacks them into one folder, and packs that as xz in two halves,
# .fa4a/ and .fa4b/ (about 34 MB each; git ignores both through .git/info/exclude). The CuTe DSL's compiler library
# alone is 193 MB unpacked, so the pack exceeds one call's 64 MiB: carry .fa4a in a first call that copies it to
# /tmp/fa4store (mkdir -p /tmp/fa4store && cp .fa4a/* /tmp/fa4store/), then, within the 30 s that the machine stays
# warm, carry .fa4b in a call that starts with
#   cat /tmp/fa4store/fa4part.aa .fa4b/fa4part.ab | xz -d | tar x -C /tmp &&
#   export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
# (the second path is what the package's .pth file would add in a site-packages folder).
set -euo pipefail
wheels=$(mktemp -d) site=$(mktemp -d)/fa4site
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
for package in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
        torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.1; do
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$wheels" "$package"
done
mkdir -p "$site"
for wheel in "$wheels"/*.whl; do
    python3 -m zipfile -e "$wheel" "$site"
done
for part in .fa4a .fa4b; do
    grep -qx "/$part/" .git/info/exclude || echo "/$part/" >> .git/info/exclude
    rm -rf "$part" && mkdir "$part"
done
tar cf - -C "$(dirname "$site")" fa4site | xz -T0 -9 | split -b 34500000 - fa4part.
mv fa4part.aa .fa4a/ && mv fa4part.ab .fa4b/
ls -la .fa4a .fa4b
