// Shared by every prime_ops kernel: stable-ABI includes, dtype dispatch, argument checks.
//
// Only the LibTorch stable ABI (torch/csrc/stable, torch/headeronly) is used, so a library built
// against one torch release loads in later ones (TORCH_TARGET_VERSION, set by the build, is the
// oldest release it serves). The checks below are the building blocks of checks.h, which every
// kernel runs before it reads a pointer: a raw torch.ops.prime_rl call raises a clear error
// instead of reading out of bounds.
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
#include <exception>
#include <initializer_list>
#include <string>

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

// The dtype as Python spells it (torch.float32), so the kernels' messages read like the fronts'.
inline std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "torch.float32";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Long: return "torch.int64";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Float8_e4m3fn: return "torch.float8_e4m3fn";
    default: return torch::headeronly::toString(t);
  }
}

inline std::string device_name(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  return std::string(t.is_cuda() ? "cuda:" : "device:") + std::to_string(t.get_device_index());
}

inline void check_contiguous(const Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous())");
}

inline void check_dim(const Tensor& t, int64_t dim, const char* what) {
  STD_TORCH_CHECK(t.dim() == dim, what, " must have ", dim, " dimensions, got ", t.dim());
}

inline void check_dtype(const Tensor& t, ScalarType dtype, const char* what) {
  STD_TORCH_CHECK(t.scalar_type() == dtype, what, " must be ", dtype_name(dtype), ", got ",
                  dtype_name(t.scalar_type()));
}

// t [size0, size1] exactly; `expected` names the sizes in the message, e.g. "[T, K] = ".
inline void check_shape(const Tensor& t, std::initializer_list<int64_t> sizes, const char* what,
                        const char* expected) {
  bool same = t.dim() == static_cast<int64_t>(sizes.size());
  int64_t d = 0;
  for (int64_t s : sizes) same = same && t.size(d++) == s;
  if (same) return;
  std::string want, got;
  for (int64_t s : sizes) want += (want.empty() ? "" : ", ") + std::to_string(s);
  for (int64_t i = 0; i < t.dim(); ++i) got += (i ? ", " : "") + std::to_string(t.size(i));
  STD_TORCH_CHECK(false, what, " must have shape ", expected, "[", want, "], got [", got, "]");
}

// `t` lives where `ref` does (the kernel reads both through raw pointers of one device).
inline void check_same_device(const Tensor& ref, const char* ref_name, const Tensor& t,
                              const char* what) {
  STD_TORCH_CHECK(t.is_cpu() == ref.is_cpu() && t.is_cuda() == ref.is_cuda() &&
                      t.get_device_index() == ref.get_device_index(),
                  what, " is on ", device_name(t), " but ", ref_name, " on ", device_name(ref),
                  "; move it with .to(", ref_name, ".device)");
}

// new_empty (or new_zeros) whose failure names the tensor: the stable ABI's own error reports
// only that aten::new_empty failed.
inline Tensor allocate(const Tensor& like, std::initializer_list<int64_t> sizes, ScalarType dtype,
                       const char* what, bool zeros = false) {
  std::string shape;
  for (int64_t s : sizes) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
  try {
    return zeros ? torch::stable::new_zeros(like, sizes, dtype)
                 : torch::stable::new_empty(like, sizes, dtype);
  } catch (const std::exception&) {
    STD_TORCH_CHECK(false, "could not allocate ", what, " [", shape, "] of ", dtype_name(dtype),
                    " on ", device_name(like),
                    " (out of memory, or more elements than a tensor can hold)");
  }
  return like;  // unreachable
}

}  // namespace prime_ops
