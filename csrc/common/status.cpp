#include "common/status.h"

namespace megamoe {
namespace {
thread_local std::string last_error_message;
}

int set_error(int code, const std::string& message) {
  last_error_message = message;
  return code;
}

}  // namespace megamoe

extern "C" const char* megamoe_last_error(void) { return megamoe::last_error_message.c_str(); }
