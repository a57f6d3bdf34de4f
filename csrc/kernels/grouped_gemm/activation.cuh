// Gated activations of the expert MLP, as policies of the gated epilogues (epilogue_gated.cuh,
// epilogue_gated_backward.cuh): h = Act::value(g) · u in the forward; in the backward,
// Act::at(g) gives act(g) (.value) and what act'(g) needs, and Act::chain(x, at) = x · act'(g).
// with_activation() maps the C API's MEGAMOE_ACTIVATION_* to its policy: the one place that lists them.
#pragma once

#include <string>

#include "common/status.h"
#include "megamoe/megamoe.h"

namespace megamoe::grouped_gemm {

// SwiGLU's gate: silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 − σ(g))). For g < -88, e^-g is inf and
// the quotients are 0, the limits.
struct Silu {
  struct At {
    float value, sigmoid, g;
  };
  __device__ __forceinline__ static float value(float g) { return __fdividef(g, 1.0f + __expf(-g)); }
  __device__ __forceinline__ static At at(float g) {
    const float sigmoid = __fdividef(1.0f, 1.0f + __expf(-g));
    return {g * sigmoid, sigmoid, g};
  }
  __device__ __forceinline__ static float chain(float x, const At& a) {
    return x * a.sigmoid * fmaf(a.g, 1.0f - a.sigmoid, 1.0f);
  }
};

// Calls f(Act{}) with the policy of `activation`, or reports an unknown one.
template <class F>
int with_activation(const std::string& fn, int activation, F&& f) {
  switch (activation) {
    case MEGAMOE_ACTIVATION_SWIGLU:
      return f(Silu{});
    default:
      return invalid_argument(fn + "unknown activation " + std::to_string(activation) +
                              " (megamoe.h lists the MEGAMOE_ACTIVATION_* values)");
  }
}

}  // namespace megamoe::grouped_gemm
