// Shared by every prime_ops kernel: stable-ABI includes, dtype dispatch, argument checks.
//
// Only the LibTorch stable ABI (torch/csrc/stable, torch/headeronly) is used, so a library built
// against one torch release loads in later ones (TORCH_TARGET_VERSION, set by the build, is the
// oldest release it serves). Argument checks that name the bad argument and the fix live in the
// Python fronts (prime_ops/native); the checks here guard the raw pointer arithmetic.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>

namespace prime_ops {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Accumulation type: fp32 for every float type but float64 (gradcheck runs in float64).
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

// Calls f(T{}) with T the C++ type of a floating dtype; `what` names the argument in the error.
template <typename F>
void dispatch_floating(ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case ScalarType::Float:
      f(float{});
      break;
    case ScalarType::Double:
      f(double{});
      break;
    case ScalarType::BFloat16:
      f(c10::BFloat16{});
      break;
    case ScalarType::Half:
      f(c10::Half{});
      break;
    default:
      STD_TORCH_CHECK(false, what, " must be float32, float64, bfloat16 or float16");
  }
}

// sum_{i < n} term(i) over 16 fixed partial sums, added pairwise at the end: the loop vectorises
// and the order (so the result) is the same whatever the ISA the build targets.
template <typename acc, typename F>
inline acc lane_sum(int64_t n, F&& term) {
  constexpr int kLanes = 16;
  acc lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += term(i + j);
  }
  for (int j = 0; i < n; ++i, ++j) lanes[j] += term(i);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

inline void check_contiguous(const Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous())");
}

inline void check_dim(const Tensor& t, int64_t dim, const char* what) {
  STD_TORCH_CHECK(t.dim() == dim, what, " must have ", dim, " dimensions, got ", t.dim());
}

}  // namespace prime_ops
