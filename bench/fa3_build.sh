#!/usr/bin/env bash
# FlashAttention-3 for the device machine, which has nvcc 13.0 but no flash-attn and no internet. Builds only what
# the trainer's FA3 backend calls: Hopper (sm_90a) kernels for head dim 128, bf16, forward and backward, variable
# length with a sliding window; every other variant (fp16, fp8, other head dims, split-KV, paged KV, softcap,
# PackGQA, sm80) is switched off through FlashAttention's own FLASH_ATTENTION_DISABLE_* build flags.
#
#   bash bench/fa3_build.sh pack     here, in the repo root: the sources from the stored mirrors (the fetch
#                                    tool's github:Dao-AILab/flash-attention, and github:NVIDIA/cutlass at
#                                    the commit its csrc/cutlass submodule pins) into .fa3src/ (git-ignored
#                                    through .git/info/exclude)
#   OUT=$OUT bash bench/fa3_build.sh build    on the device, carrying .fa3src: compiles, imports the module,
#                                    and packs it into $OUT/fa3/fa3.tar.xz.part* (copy those into .fa3/)
# Carried as .fa3/, bench/common.sh unpacks it to /tmp/fa3site and puts it on PYTHONPATH: `import
# flash_attn_interface` works, and --attn_backend=auto takes FA3.
set -uo pipefail
FA_REPO=${FA_REPO:-/work/.mirror/Dao-AILab+flash-attention/repo}
CUTLASS_REPO=${CUTLASS_REPO:-/work/.mirror/NVIDIA+cutlass/repo}

fa3_pack() {
    local tmp pin
    tmp=$(mktemp -d)
    mkdir -p "$tmp/flash-attention/csrc/cutlass" .fa3src
    git -C "$FA_REPO" archive HEAD hopper README.md | tar -x -C "$tmp/flash-attention"  # setup.py reads README.md
    pin=$(git -C "$FA_REPO" ls-tree HEAD csrc/cutlass | awk '{print $3}')
    git -C "$CUTLASS_REPO" archive "$pin" include | tar -x -C "$tmp/flash-attention/csrc/cutlass"
    tar -C "$tmp" -cJf .fa3src/fa3src.tar.xz flash-attention
    echo "flash-attention $(git -C "$FA_REPO" rev-parse --short HEAD), cutlass ${pin:0:9}: $(du -h .fa3src/fa3src.tar.xz)"
    rm -rf "$tmp"
}

fa3_build() {
    local src=/tmp/fa3build
    rm -rf "$src" && mkdir -p "$src" "$OUT/fa3"
    tar -xJf .fa3src/fa3src.tar.xz -C "$src"
    local flag
    for flag in FP16 FP8 SPLIT PAGEDKV APPENDKV SOFTCAP PACKGQA CLUSTER SM80 HDIM64 HDIM96 HDIM192 HDIM256 \
                HDIMDIFF64 HDIMDIFF192; do
        export "FLASH_ATTENTION_DISABLE_$flag=TRUE"
    done
    export FLASH_ATTENTION_OFFLINE_BUILD=1 MAX_JOBS=${MAX_JOBS:-8} NVCC_THREADS=${NVCC_THREADS:-2}
    local start=$SECONDS
    (cd "$src/flash-attention/hopper" && python3 setup.py build_ext --inplace) > "$OUT/fa3/build.log" 2>&1
    local rc=$?
    echo "build exit $rc after $((SECONDS - start)) s"
    grep -E "error|Error" "$OUT/fa3/build.log" | head -20
    [ $rc = 0 ] || return $rc
    local site=/tmp/fa3site
    rm -rf "$site" && mkdir -p "$site"
    (cd "$src/flash-attention/hopper" && cp -r flash_attn_interface.py flash_attn_config.py flash_attn_3 "$site/")
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import flash_attn_interface; print('flash_attn_interface imports')"
    tar -C "$site" -cJf /tmp/fa3.tar.xz .
    split -b 15M /tmp/fa3.tar.xz "$OUT/fa3/fa3.tar.xz.part"
    du -sh "$site" /tmp/fa3.tar.xz
}

case "${1:-}" in
    pack) fa3_pack ;;
    build) fa3_build ;;
    *) echo "usage: bash bench/fa3_build.sh pack|build" >&2; exit 2 ;;
esac
