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

// One bad call of an entry point that takes no plan: `change` spoils the good arguments.
template <class Args>
struct BadArguments {
  void (*change)(Args&);
  const char* message;
};

// entry rejects null args and every case with its message, and returns OK without a launch when
// `empty` leaves it nothing to do.
template <class Args>
void expect_argument_checks(int (*entry)(const Args*, void*), const Args& good,
                            std::initializer_list<BadArguments<Args>> cases, void (*empty)(Args&)) {
  expect_rejected(entry(nullptr, nullptr), "args must be non-null");
  for (const BadArguments<Args>& c : cases) {
    Args a = good;
    c.change(a);
    expect_rejected(entry(&a, nullptr), c.message);
  }
  Args a = good;
  empty(a);
  EXPECT_EQ(entry(&a, nullptr), MEGAMOE_OK) << megamoe_last_error();
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
  const char* sizes = "need rows and k multiples of 128 and scales_ld 0";
  expect_argument_checks<Quantize>(megamoe_quantize_blocks_fp8, good_blocks(),
                                   {{[](Quantize& a) { a.rows = 100; }, sizes},
                                    {[](Quantize& a) { a.k = 64; }, sizes},
                                    {[](Quantize& a) { a.scales_ld = 3; }, sizes},
                                    {[](Quantize& a) { a.rows = -128; }, sizes},
                                    {[](Quantize& a) { a.q = nullptr; }, "null pointer"},
                                    {[](Quantize& a) { a.a = check_buf + 8; }, "the bf16 matrix must be 16-byte"}},
                                   [](Quantize& a) { a.rows = 0; });
}

TEST(QuantizeValidation, TransposedBlocksRejectBadArguments) {
  using Args = megamoe_quantize_blocks_transposed_fp8_args;
  const char* sizes = "need batches >= 0 and n and k positive multiples of 128";
  expect_argument_checks<Args>(megamoe_quantize_blocks_transposed_fp8,
                               Args{check_buf, check_buf, reinterpret_cast<float*>(check_buf), 2, 256, 384},
                               {{[](Args& a) { a.n = 200; }, sizes},
                                {[](Args& a) { a.k = 0; }, sizes},
                                {[](Args& a) { a.batches = -1; }, sizes},
                                {[](Args& a) { a.q_t = check_buf + 8; }, "w and q_t must be 16-byte aligned"},
                                {[](Args& a) { a.scales_t = nullptr; }, "null pointer"}},
                               [](Args& a) { a.batches = 0; });
}

TEST(TransposeValidation, RejectsBadArguments) {
  using Args = megamoe_transpose_fp8_args;
  const char* sizes = "need batches >= 0 and rows and cols positive multiples of 128";
  expect_argument_checks<Args>(megamoe_transpose_fp8, Args{check_buf, check_buf, 2, 128, 256},
                               {{[](Args& a) { a.rows = 96; }, sizes},
                                {[](Args& a) { a.cols = 0; }, sizes},
                                {[](Args& a) { a.batches = -1; }, sizes},
                                {[](Args& a) { a.out = check_buf + 4; }, "in and out must be 16-byte aligned"},
                                {[](Args& a) { a.in = nullptr; }, "null pointer"}},
                               [](Args& a) { a.batches = 0; });
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
