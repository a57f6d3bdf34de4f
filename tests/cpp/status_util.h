// Checks for the C API's error contract: a bad argument is rejected before any CUDA work, and
// megamoe_last_error() says why.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "megamoe/megamoe.h"

// `status` (an API call's return) is MEGAMOE_ERROR_INVALID_ARGUMENT with a message containing `why`.
inline void expect_rejected(int status, const std::string& why) {
  EXPECT_EQ(status, MEGAMOE_ERROR_INVALID_ARGUMENT) << why;
  EXPECT_NE(std::string(megamoe_last_error()).find(why), std::string::npos) << megamoe_last_error();
}
