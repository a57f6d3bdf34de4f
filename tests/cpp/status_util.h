// Checks for the C API's error contract: a bad argument is rejected before any CUDA work, and
// megamoe_last_error() says why. The checks read no array, so the rejection tests point every
// pointer at one host buffer and run without a GPU.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "megamoe/megamoe.h"

// `status` (an API call's return) is MEGAMOE_ERROR_INVALID_ARGUMENT with a message containing `why`.
inline void expect_rejected(int status, const std::string& why) {
  EXPECT_EQ(status, MEGAMOE_ERROR_INVALID_ARGUMENT) << why;
  EXPECT_NE(std::string(megamoe_last_error()).find(why), std::string::npos) << megamoe_last_error();
}

// What every pointer of a rejection test points at (16-byte aligned; never read).
alignas(16) inline char check_buf[64];

// The rejection tests' plan shape: T * K = 256 routes over 2 local experts, 4 pool blocks.
constexpr megamoe_routing_shape kCheckShape{64, 4, 2, 0, 2};

// A plan for the argument checks: its shape, and every array at check_buf.
inline megamoe_routing_plan unread_plan(const megamoe_routing_shape& shape = kCheckShape) {
  auto* ints = reinterpret_cast<int32_t*>(check_buf);
  return {ints, ints, ints, ints, ints, ints, ints, ints, check_buf, shape};
}

// One bad call of a plan-consuming entry point: `change` spoils the good plan or arguments.
template <class Args>
struct Rejection {
  std::function<void(megamoe_routing_plan&, Args&)> change;
  const char* message;
};

template <class Args>
using PlanEntry = int (*)(const megamoe_routing_plan*, const Args*, void*);

// entry(plan, args) rejects every case with its message; so it does a null plan, null args and a plan
// shape no routing can have (top_k < 1, no local experts), which every plan consumer checks.
template <class Args>
void expect_rejections(PlanEntry<Args> entry, const megamoe_routing_plan& plan, const Args& args,
                       std::initializer_list<Rejection<Args>> cases) {
  expect_rejected(entry(nullptr, &args, nullptr), "plan must be non-null");
  expect_rejected(entry(&plan, nullptr, nullptr), "args must be non-null");
  const std::initializer_list<Rejection<Args>> shapes = {
      {[](megamoe_routing_plan& p, Args&) { p.shape.top_k = 0; }, "plan.shape: top_k must be >= 1"},
      {[](megamoe_routing_plan& p, Args&) { p.shape.num_local_experts = 0; },
       "plan.shape: local experts [0, 0) must lie inside"},
  };
  for (const auto list : {shapes, cases}) {
    for (const Rejection<Args>& c : list) {
      megamoe_routing_plan bad_plan = plan;
      Args bad_args = args;
      c.change(bad_plan, bad_args);
      expect_rejected(entry(&bad_plan, &bad_args, nullptr), c.message);
    }
  }
}
