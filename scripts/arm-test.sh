#!/usr/bin/env bash
# Run qkv's kernel tests on its Arm level (aarch64, NEON) on an x86-64 machine, under QEMU's
# user-mode emulation: an aarch64 Debian (bookworm, Python 3.11), an aarch64 torch from PyPI,
# the kernels cross-compiled by scripts/arm_build.py, the tests run by that Python.
#
#   scripts/arm-test.sh                      # all of tests/kernels, 2 workers (~45 min on 2 cores)
#   scripts/arm-test.sh --ci                 # CI's subset (CI_TESTS below; ~4 min)
#   scripts/arm-test.sh tests/kernels/test_decode.py -k fp64    # pytest's arguments
#
# --ci (`make arm-test-ci`, what .ci/run runs) tests every kernel family once: the tests that
# hold the neon build against fp64 or PyTorch references, one case of each repetition (the
# same check at more sizes, paths or shapes: the long caches, the x86 paths' scripts, bf16
# variants), and fewer drawn inputs (Hypothesis profile qkv-emulated-ci, tests/conftest.py;
# QKV_FUZZ_EXAMPLES). What runs the same Python code on every CPU (fp64 on the PyTorch-ops
# kernel, argument checks, the other levels' tables) is left to `make test` and the full run.
# A name in CI_TESTS that no longer exists fails the run ("not found"): rename it there too.
#
# Correctness only: emulated time says nothing about an Arm CPU's speed. Everything is kept
# in $QKV_ARM_DIR (default ~/.cache/qkv-arm, ~1.3 GB) and reused. The first run needs root
# (apt-get: qemu-user, debootstrap, the cross compiler; binfmt_misc, so that the tests'
# subprocesses run emulated too) and the package registries (Debian's and PyPI).
# Needs .venv from `make venv` (its Python runs the build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
DIR=${QKV_ARM_DIR:-$HOME/.cache/qkv-arm}
# the newest torch on PyPI whose aarch64 wheel is a CPU build (later ones need CUDA's libraries)
TORCH_ARM=2.10.0
mkdir -p "$DIR"
CI_RUN=0
if [ "${1:-}" = --ci ]; then CI_RUN=1; shift; fi

# CI's subset, by kernel family (pytest node ids; K=tests/kernels)
K=tests/kernels
CI_TESTS=(
    # flash, fused kernel: fp32 forward+backward against fp64 (random shapes, GQA, masks,
    # windows, tiles), bf16 within PyTorch's bf16 error, rows with no key, a long fp32 call
    # against the PyTorch-ops kernel, neon's dispatch rules, the logit bound, the bf16 switch
    $K/test_flash_native.py::test_fused_fp32_equals_math_values_lse_gradients
    "$K/test_flash_native.py::test_bf16_error_within_pytorch_bf16_error[shape2-fused]"
    "$K/test_flash_native.py::test_bf16_paths_equal_math_within_bf16_error[widen]"
    $K/test_flash_native.py::test_rows_with_no_visible_key_are_zero_with_zero_grads
    $K/test_flash_native.py::test_fused_and_ops_kernels_agree
    $K/test_flash_native.py::test_auto_rules_for_the_fused_kernel
    $K/test_flash_native.py::test_max_abs_product_is_the_dispatchers_logit_bound
    $K/test_flash_native.py::test_bf16_matmul_switch_picks_the_path_and_rejects_unknown_values
    $K/test_flash.py::test_a_single_keys_mask_or_bias_column_with_any_stride
    $K/test_flash.py::test_varlen_cross_lengths_and_errors
    # flash variants against fp64: bias, ALiBi, relative tables, soft-capping (mixed, random),
    # -inf biases, block masks (random, and the row groups of partial blocks)
    $K/test_flash_variants.py::test_variants_equal_fp64_math_values_and_gradients
    $K/test_flash_variants.py::test_block_masks_equal_the_dense_mask_values_and_gradients
    $K/test_flash_variants.py::test_bias_with_minus_inf_rows_gives_zeros_like_the_reference
    "$K/test_flash_variants.py::test_row_groups_of_partial_blocks_equal_fp64[dtype0]"
    # adversarial magnitudes on every backend (QKV_FUZZ_EXAMPLES drawn inputs)
    $K/test_fuzz_kernels.py::test_every_backend_matches_fp64_on_adversarial_inputs
    $K/test_fuzz_kernels.py::test_flash_tiles_match_fp64_with_lse
    $K/test_fuzz_kernels.py::test_huge_logits_give_the_argmax_value
    $K/test_fuzz_kernels.py::test_huge_blocks_are_clamped_to_the_sequence
    # decode over fp32 and bf16 caches against fp64: random calls (1-64 rows per kv head,
    # strided caches, masks, pieces, threads), the few-rows script (beams, a 32 MiB call),
    # rows with no key, bf16 within PyTorch's error, huge logits, neon's dispatch rows
    $K/test_decode.py::test_decode_matches_fp64_values_and_lse
    "$K/test_decode.py::test_every_fp32_few_rows_path_matches_fp64[auto]"
    $K/test_decode.py::test_rows_without_visible_keys_are_zero_with_lse_minus_inf
    $K/test_decode.py::test_bf16_error_is_within_torch_sdpa_own
    $K/test_decode.py::test_huge_logits_give_the_argmax_value
    $K/test_decode.py::test_leading_batch_dims_and_unbatched_inputs
    $K/test_decode.py::test_auto_picks_decode_for_few_queries_and_says_why
    $K/test_decode.py::test_selected_heads_weights_through_decode_match_math
    # decode over the int8 cache: its row format, random calls against fp64 of the
    # dequantized rows, read as stored and widened runs, beams' rows, the cache, attention
    $K/test_kv_int8.py::test_quantized_rows_are_within_half_a_step
    $K/test_kv_int8.py::test_decode_over_int8_rows_matches_fp64
    "$K/test_kv_int8.py::test_int8_rows_for_1_to_64_query_rows[False-4-4]"
    "$K/test_kv_int8.py::test_int8_rows_for_1_to_64_query_rows[True-4-16]"
    $K/test_kv_int8.py::test_beams_read_in_place_from_int8_rows
    $K/test_kv_int8.py::test_int8_cache_stores_packed_rows_through_growth_beams_and_batch_rows
    $K/test_kv_int8.py::test_attention_over_an_int8_cache_equals_the_dequantized_cache
    # int8 linears: integer sums exact and outputs within the bound (random, long rows,
    # translator shapes on 2 threads), edge magnitudes, activations, a quantized translator
    $K/test_int8.py::test_integer_sums_exact_and_output_within_bound
    $K/test_int8.py::test_long_rows_exact
    $K/test_int8.py::test_translator_shapes_exact_with_threads
    $K/test_int8.py::test_rows_are_independent
    $K/test_int8.py::test_huge_and_tiny_magnitudes_stay_finite
    $K/test_int8.py::test_non_finite_row_gives_nan_row_only
    $K/test_int8.py::test_relu_and_gelu_fused_like_float
    $K/test_int8.py::test_empty_shapes
    $K/test_int8.py::test_small_batch_linear_matches_and_fuses
    $K/test_int8.py::test_torch_fallback_gives_the_same_integers
    $K/test_int8.py::test_quantized_seq2seq_translates
    "$K/test_int8.py::test_bad_input_errors[op-x-width]"
    # packed small linears
    "$K/test_packed.py::test_packed_equals_linear[True-shape1]"
    "$K/test_packed.py::test_packed_equals_linear[False-shape4]"
    $K/test_packed.py::test_weight_change_rebuilds_panels_and_grad_uses_linear
    $K/test_packed.py::test_pack_linears_same_logits_and_state_dict
    # the generation step's kernels against torch: beam top-k, argmax, small linears, the
    # decode kernel reading beams through a rows table and a larger cache, fp32 over bf16
    $K/test_step_kernels.py::test_beam_topk_equals_log_softmax_then_topk
    $K/test_step_kernels.py::test_beam_topk_fills_missing_candidates_with_minus_inf
    "$K/test_step_kernels.py::test_argmax_rows_equals_torch_argmax_after_blocking[-1-17]"
    "$K/test_step_kernels.py::test_argmax_rows_equals_torch_argmax_after_blocking[mid-8000]"
    $K/test_step_kernels.py::test_greedy_pick_writes_the_argmax_and_counts_eos
    "$K/test_step_kernels.py::test_small_linear_matches_fp64[True-False-300-130-7]"
    "$K/test_step_kernels.py::test_small_linear_matches_fp64[False-True-63-37-13]"
    "$K/test_step_kernels.py::test_small_batch_linear_equals_f_linear[5-gelu]"
    "$K/test_step_kernels.py::test_decode_reads_reordered_beams_through_the_rows_table[3-6-2-45]"
    "$K/test_step_kernels.py::test_decode_reads_a_cache_larger_than_the_batch[6-2-45]"
    "$K/test_step_kernels.py::test_decode_fp32_queries_over_a_bf16_cache[33]"
    $K/test_step_kernels.py::test_gathered_cache_for_other_paths
    # whole files: the finite look; levels, loading and refusals; the C++ runtime
    $K/test_finite.py
    $K/test_levels.py
    $K/test_linkage.py
)

need=()
command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need+=(g++-aarch64-linux-gnu)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "arm-test: missing ${need[*]}: install them (Debian: apt-get install ${need[*]})" >&2
        exit 1
    fi
    echo "arm-test: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# an aarch64 Debian to run: debootstrap's first stage downloads the packages, which are
# unpacked as they are (no maintainer scripts: nothing aarch64 runs during the setup)
ROOTFS=$DIR/rootfs
if [ ! -x "$ROOTFS/usr/bin/python3.11" ]; then
    echo "arm-test: making an aarch64 Debian in $ROOTFS"
    rm -rf "$ROOTFS.tmp"
    /usr/sbin/debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 bookworm \
        "$ROOTFS.tmp" http://deb.debian.org/debian >/dev/null
    for deb in "$ROOTFS.tmp"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$ROOTFS.tmp"; done
    rm -rf "$ROOTFS" && mv "$ROOTFS.tmp" "$ROOTFS"
fi
export QEMU_LD_PREFIX=$ROOTFS  # where the emulated programs find their loader and libraries

# binfmt_misc runs aarch64 programs through QEMU (the tests start Python subprocesses):
# an aarch64 ELF executable's header, unless a handler for it is registered already
BINFMT=/proc/sys/fs/binfmt_misc
[ -e $BINFMT/register ] || mount -t binfmt_misc binfmt_misc $BINFMT
if ! grep -qs "^magic 7f454c460201010000000000000000000200b700" $BINFMT/*; then
    magic='\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    echo ":qkv-aarch64:M::$magic:$mask:$(command -v qemu-aarch64):" > $BINFMT/register
fi

# aarch64 wheels into one folder (pip's --platform; the dependencies named, since pip would
# read torch's markers for this x86-64 machine); made again when this list changes
SITE=$DIR/site-torch-$TORCH_ARM
WANT="torch==$TORCH_ARM filelock typing-extensions sympy networkx jinja2 fsspec numpy safetensors
      tqdm rich tokenizers transformers setuptools pytest pytest-xdist hypothesis"
if [ "$(cat "$SITE/.packages" 2>/dev/null)" != "$(echo $WANT)" ]; then
    echo "arm-test: aarch64 torch $TORCH_ARM and the test tools into $SITE"
    rm -rf "$SITE.tmp"
    plat=(--only-binary=:all: --python-version 311 --implementation cp
          --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
          --platform manylinux2014_aarch64)
    "$PY" -m pip install -q --no-warn-script-location --target "$SITE.tmp" "${plat[@]}" \
        --no-deps "torch==$TORCH_ARM"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-warn-script-location --target "$SITE.tmp" "${plat[@]}" \
        ${WANT#torch==$TORCH_ARM}
    echo $WANT > "$SITE.tmp/.packages"
    rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
fi

"$PY" scripts/arm_build.py --torch-dir "$SITE" --out "$DIR/pkg-$TORCH_ARM"

export PYTHONPATH=$DIR/pkg-$TORCH_ARM:$SITE HF_HUB_OFFLINE=1
ARMPY=$ROOTFS/usr/bin/python3.11
"$ARMPY" - <<'PY'
import platform

import torch

from qkv.kernels._native import native_status

status = native_status()
print(f"arm-test: {platform.machine()}, torch {torch.__version__}: {status}")
assert platform.machine() == "aarch64" and "level neon (prebuilt)" in status, status
PY
# tests/kernels (--ci: CI_TESTS) unless the arguments name tests of their own
paths=(tests/kernels)
profile=qkv-emulated  # tests/conftest.py
if [ $CI_RUN = 1 ]; then
    paths=("${CI_TESTS[@]}") profile=qkv-emulated-ci
    export QKV_FUZZ_EXAMPLES=${QKV_FUZZ_EXAMPLES:-10}  # tests/kernels/test_fuzz_kernels.py
fi
for a in "$@"; do [[ $a == tests* ]] && paths=(); done
export QKV_HYPOTHESIS_PROFILE=${QKV_HYPOTHESIS_PROFILE:-$profile}
exec "$ARMPY" -m pytest -q -p no:cacheprovider -n 2 "$@" "${paths[@]}"
