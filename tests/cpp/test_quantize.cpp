// Block-FP8 quantisation and transpose (csrc/kernels/fp8/): the argument checks, before any CUDA call,
// so without a GPU. Their results are tested against the torch ops in tests/python/test_fp8.py.
#include <gtest/gtest.h>

#include "megamoe/megamoe.h"
#include "status_util.h"

namespace {

using Quantize = megamoe_quantize_fp8_args;

megamoe_quantize_fp8_args good_blocks() {
  return {check_buf, check_buf, reinterpret_cast<float*>(check_buf), 256, 384, 0};
}

}  // namespace

TEST(QuantizeValidation, RowsRejectBadArguments) {
  expect_rejected(megamoe_quantize_rows_fp8(nullptr, nullptr), "args must be non-null");
  Quantize a = good_blocks();
  a.k = 100;
  expect_rejected(megamoe_quantize_rows_fp8(&a, nullptr), "k a positive multiple of 128, got rows 256, k 100");
  a = good_blocks();
  a.a = check_buf + 8;
  expect_rejected(megamoe_quantize_rows_fp8(&a, nullptr), "the bf16 rows must be 16-byte and the e4m3 rows 8-byte");
  a = good_blocks();
  a.q = check_buf + 4;
  expect_rejected(megamoe_quantize_rows_fp8(&a, nullptr), "the e4m3 rows 8-byte aligned");
  a = good_blocks();
  a.scales_ld = 2;
  expect_rejected(megamoe_quantize_rows_fp8(&a, nullptr), "scales_ld must be 0 (k-block major) or at least k / 128");
  megamoe_dequantize_fp8_args d{check_buf, reinterpret_cast<const float*>(check_buf), check_buf, 4, 0};
  expect_rejected(megamoe_dequantize_rows_fp8(&d, nullptr), "k a positive multiple of 128");
  d.k = 128;
  d.a = check_buf + 2;
  expect_rejected(megamoe_dequantize_rows_fp8(&d, nullptr), "the bf16 rows must be 8-byte");
}

TEST(QuantizeValidation, BlocksRejectBadArguments) {
  expect_rejected(megamoe_quantize_blocks_fp8(nullptr, nullptr), "args must be non-null");
  const char* sizes = "need rows and k multiples of 128 and scales_ld 0";
  for (const auto change : {+[](Quantize& a) { a.rows = 100; }, +[](Quantize& a) { a.k = 64; },
                            +[](Quantize& a) { a.scales_ld = 3; }, +[](Quantize& a) { a.rows = -128; }}) {
    Quantize a = good_blocks();
    change(a);
    expect_rejected(megamoe_quantize_blocks_fp8(&a, nullptr), sizes);
  }
  Quantize a = good_blocks();
  a.q = nullptr;
  expect_rejected(megamoe_quantize_blocks_fp8(&a, nullptr), "null pointer");
  a = good_blocks();
  a.a = check_buf + 8;
  expect_rejected(megamoe_quantize_blocks_fp8(&a, nullptr), "the bf16 matrix must be 16-byte");
  a = good_blocks();
  a.rows = 0;  // nothing to quantise: no launch
  EXPECT_EQ(megamoe_quantize_blocks_fp8(&a, nullptr), MEGAMOE_OK) << megamoe_last_error();
}

TEST(TransposeValidation, RejectsBadArguments) {
  using Transpose = megamoe_transpose_fp8_args;
  expect_rejected(megamoe_transpose_fp8(nullptr, nullptr), "args must be non-null");
  const Transpose good{check_buf, check_buf, 2, 128, 256};
  const char* sizes = "need batches >= 0 and rows and cols positive multiples of 128";
  for (const auto change : {+[](Transpose& a) { a.rows = 96; }, +[](Transpose& a) { a.cols = 0; },
                            +[](Transpose& a) { a.batches = -1; }}) {
    Transpose a = good;
    change(a);
    expect_rejected(megamoe_transpose_fp8(&a, nullptr), sizes);
  }
  Transpose a = good;
  a.out = check_buf + 4;
  expect_rejected(megamoe_transpose_fp8(&a, nullptr), "in and out must be 16-byte aligned");
  a = good;
  a.in = nullptr;
  expect_rejected(megamoe_transpose_fp8(&a, nullptr), "null pointer");
  a = good;
  a.batches = 0;  // nothing to move: no launch
  EXPECT_EQ(megamoe_transpose_fp8(&a, nullptr), MEGAMOE_OK) << megamoe_last_error();
}

TEST(QuantizeValidation, TransposedRejectBadArguments) {
  using Args = megamoe_transpose_quantize_fp8_args;
  auto* fp = reinterpret_cast<float*>(check_buf);
  const char* nulls = "src, q_t, scales and the plan's num_blocks must be non-null";
  expect_rejections<Args>(
      megamoe_transpose_quantize_fp8, unread_plan(),
      Args{check_buf, check_buf, fp, 256, MEGAMOE_FP8_ALONG_ROWS, MEGAMOE_ROWS_TOKENS, MEGAMOE_SRC_E4M3, fp},
      {
          {[](auto&, auto& a) { a.src = nullptr; }, nulls},
          {[](auto&, auto& a) { a.scales = nullptr; }, nulls},
          {[](auto& pl, auto&) { pl.num_blocks = nullptr; }, nulls},
          {[](auto& pl, auto&) { pl.slot_to_route = nullptr; }, "token rows need the plan's slot_to_route"},
          {[](auto&, auto& a) { a.src_rows = 2; }, "src_rows must be MEGAMOE_ROWS_POOL or MEGAMOE_ROWS_TOKENS, got 2"},
          {[](auto&, auto& a) { a.q_t = check_buf + 8; }, "src and q_t must be 16-byte aligned"},
          {[](auto&, auto& a) { a.cols = 200; },
           "cols must be a positive multiple of 128 (block-FP8 scale blocks), got 200"},
          {[](auto&, auto& a) { a.blocks = 2; },
           "blocks must be MEGAMOE_FP8_ALONG_ROWS or MEGAMOE_FP8_IN_BLOCKS, got 2"},
          {[](auto&, auto& a) { a.src_dtype = 2; }, "src_dtype must be MEGAMOE_SRC_BF16 or MEGAMOE_SRC_E4M3, got 2"},
          {[](auto&, auto& a) { a.src_scales = nullptr; }, "an e4m3 src needs its src_scales"},
      });
}
