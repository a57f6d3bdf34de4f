// Gated activations of the expert MLP, as policies of the gated epilogues (epilogue_gated.cuh,
// epilogue_gated_backward.cuh). A policy is made on the device from the C API's activation_limit
// (Act::of; only the clamped SwiGLU reads it). With g', u' the gate and up values the activation
// takes (clamped by SiluLimit, g and u as they are otherwise):
//   forward:  h = act.gated(g, u) = act(g') · u'
//   backward: a = act.at(g, u) holds act(g') (.value) and u' (.up), so h = a.value · a.up;
//             act.chain(x, a) = x · d act(g') / dg and act.up_chain(x, a) = x · du' / du.
// with_activation() maps the C API's MEGAMOE_ACTIVATION_* to its policy: the one place that lists them.
#pragma once

#include <cfloat>
#include <cstdio>
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
    float value, sigmoid, up;
  };
  __host__ __device__ static Silu of(float) { return {}; }
  __device__ __forceinline__ static float value(float g) { return g * sigmoid(g); }
  __device__ __forceinline__ float gated(float g, float u) const { return value(g) * u; }
  __device__ __forceinline__ At at(float g, float u) const {
    const float s = sigmoid(g);
    return {g * s, s, u};
  }
  __device__ __forceinline__ float chain(float x, const At& a) const {
    return x * fmaf(a.value, 1.0f - a.sigmoid, a.sigmoid);
  }
  __device__ __forceinline__ float up_chain(float x, const At&) const { return x; }
};

// GeGLU's gate, GELU in its tanh approximation (as torch's gelu(approximate="tanh")). With
// y = √(2/π) (g + 0.044715 g³), ½ (1 + tanh y) = σ(2y), so gelu(g) = g σ(2y) and
// gelu'(g) = σ(2y) + g σ(2y) (1 − σ(2y)) · 2 √(2/π) (1 + 3 · 0.044715 g²).
struct GeluTanh {
  static constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 √(2/π)
  static constexpr float kCubic = 0.044715f;
  struct At {
    float value, sigmoid, g, up;
  };
  __host__ __device__ static GeluTanh of(float) { return {}; }
  __device__ __forceinline__ static float sigmoid_2y(float g) {
    return sigmoid(kTwoSqrtTwoOverPi * fmaf(kCubic * g, g * g, g));
  }
  __device__ __forceinline__ float gated(float g, float u) const { return g * sigmoid_2y(g) * u; }
  __device__ __forceinline__ At at(float g, float u) const {
    const float sigmoid = sigmoid_2y(g);
    return {g * sigmoid, sigmoid, g, u};
  }
  __device__ __forceinline__ float chain(float x, const At& a) const {
    const float slope = kTwoSqrtTwoOverPi * fmaf(3.0f * kCubic * a.g, a.g, 1.0f);
    return x * fmaf(a.g * a.sigmoid * (1.0f - a.sigmoid), slope, a.sigmoid);
  }
  __device__ __forceinline__ float up_chain(float x, const At&) const { return x; }
};

// SwiGLU clamped at L = limit (DeepSeek-V4's swiglu_limit): g' = min(g, L), u' = clamp(u, −L, L),
// as torch's clamp computes them (a NaN stays NaN), with no gradient at or past a bound, nor at a NaN
// (megamoe.activation.gated's convention, whichever way a torch version's clamp takes a bound).
struct SiluLimit {
  float limit;
  struct At : Silu::At {
    bool gate_inside, up_inside;
  };
  __host__ __device__ static SiluLimit of(float limit) { return {limit}; }
  __device__ __forceinline__ float gate(float g) const { return g > limit ? limit : g; }
  __device__ __forceinline__ float up(float u) const { return u > limit ? limit : (u < -limit ? -limit : u); }
  __device__ __forceinline__ float gated(float g, float u) const { return Silu::value(gate(g)) * up(u); }
  __device__ __forceinline__ At at(float g, float u) const {
    return {Silu{}.at(gate(g), up(u)), g < limit, fabsf(u) < limit};
  }
  __device__ __forceinline__ float chain(float x, const At& a) const { return a.gate_inside ? Silu{}.chain(x, a) : 0.f; }
  __device__ __forceinline__ float up_chain(float x, const At& a) const { return a.up_inside ? x : 0.f; }
};

// Calls f(Act{}) with the policy of `activation`, or reports an unknown one or a limit it cannot take.
template <class F>
int with_activation(const std::string& fn, int activation, float limit, F&& f) {
  switch (activation) {
    case MEGAMOE_ACTIVATION_SWIGLU:
      return f(Silu{});
    case MEGAMOE_ACTIVATION_GEGLU:
      return f(GeluTanh{});
    case MEGAMOE_ACTIVATION_SWIGLU_LIMIT:
      if (!(limit > 0.f && limit <= FLT_MAX)) {
        char text[32];
        std::snprintf(text, sizeof text, "%g", limit);
        return invalid_argument(fn + "MEGAMOE_ACTIVATION_SWIGLU_LIMIT needs a positive finite activation_limit, got " +
                                text);
      }
      return f(SiluLimit{});
    default:
      return invalid_argument(fn + "unknown activation " + std::to_string(activation) +
                              " (megamoe.h lists the MEGAMOE_ACTIVATION_* values)");
  }
}

}  // namespace megamoe::grouped_gemm
