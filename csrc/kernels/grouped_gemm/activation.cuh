// Gated activations of the expert MLP, as policies of the gated epilogues (epilogue_gated.cuh,
// epilogue_gated_backward.cuh): h = Act::value(g) · u in the forward; in the backward,
// Act::at(g) gives act(g) (.value) and what act'(g) needs, and Act::chain(x, at) = x · act'(g).
// with_activation() maps the C API's MEGAMOE_ACTIVATION_* to its policy: the one place that lists them.
#pragma once

#include <string>

#include "common/status.h"
#include "megamoe/megamoe.h"

namespace megamoe::grouped_gemm {

// σ(x) = 1 / (1 + e^-x) from the SFU's ex2 and rcp, flushing subnormals: 4 instructions, where
// __expf and a division add range fix-ups around each. Below x ≈ -87.3, where σ(x) would be
// subnormal, it is 0.
__device__ __forceinline__ float sigmoid(float x) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
  return s;
}

// SwiGLU's gate: silu(g) = g σ(g), silu'(g) = σ(g) (1 + g (1 − σ(g))) = σ(g) + silu(g) (1 − σ(g)).
struct Silu {
  struct At {
    float value, sigmoid;
  };
  __device__ __forceinline__ static float value(float g) { return g * sigmoid(g); }
  __device__ __forceinline__ static At at(float g) {
    const float s = sigmoid(g);
    return {g * s, s};
  }
  __device__ __forceinline__ static float chain(float x, const At& a) {
    return x * fmaf(a.value, 1.0f - a.sigmoid, a.sigmoid);
  }
};

// GeGLU's gate, GELU in its tanh approximation (as torch's gelu(approximate="tanh")). With
// y = √(2/π) (g + 0.044715 g³), ½ (1 + tanh y) = σ(2y), so gelu(g) = g σ(2y) and
// gelu'(g) = σ(2y) + g σ(2y) (1 − σ(2y)) · 2 √(2/π) (1 + 3 · 0.044715 g²).
struct GeluTanh {
  static constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 √(2/π)
  static constexpr float kCubic = 0.044715f;
  struct At {
    float value, sigmoid, g;
  };
  __device__ __forceinline__ static float sigmoid_2y(float g) {
    return sigmoid(kTwoSqrtTwoOverPi * fmaf(kCubic * g, g * g, g));
  }
  __device__ __forceinline__ static float value(float g) { return g * sigmoid_2y(g); }
  __device__ __forceinline__ static At at(float g) {
    const float sigmoid = sigmoid_2y(g);
    return {g * sigmoid, sigmoid, g};
  }
  __device__ __forceinline__ static float chain(float x, const At& a) {
    const float slope = kTwoSqrtTwoOverPi * fmaf(3.0f * kCubic * a.g, a.g, 1.0f);
    return x * fmaf(a.g * a.sigmoid * (1.0f - a.sigmoid), slope, a.sigmoid);
  }
};

// Calls f(Act{}) with the policy of `activation`, or reports an unknown one.
template <class F>
int with_activation(const std::string& fn, int activation, F&& f) {
  switch (activation) {
    case MEGAMOE_ACTIVATION_SWIGLU:
      return f(Silu{});
    case MEGAMOE_ACTIVATION_GEGLU:
      return f(GeluTanh{});
    default:
      return invalid_argument(fn + "unknown activation " + std::to_string(activation) +
                              " (megamoe.h lists the MEGAMOE_ACTIVATION_* values)");
  }
}

}  // namespace megamoe::grouped_gemm
