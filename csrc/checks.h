// The argument contract of each prime_rl op, checked by its CPU and CUDA kernels before they
// read a pointer. The Python fronts and fakes (prime_ops/native/__init__.py, `_check_*`) check
// the same conditions with the same limits, so a call is refused alike whether it comes through
// the front, a traced graph (the fake) or torch.ops.prime_rl directly. Checks of values (expert
// ids, row_map entries) need the data, so only the kernels run them.
#pragma once

#include "common.h"

#include <optional>
#include <string>

namespace prime_ops {

// Limits every layer agrees on. They keep every size the kernels compute far from int64
// overflow and within what the CUDA kernels launch (per-expert and per-slot shared memory).
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxTopK = 4096;
constexpr int64_t kMaxAlignment = 65536;
constexpr int64_t kFp8Block = 128;

inline void check_floating(const Tensor& t, const char* what) {
  const ScalarType s = t.scalar_type();
  STD_TORCH_CHECK(s == ScalarType::Float || s == ScalarType::Double ||
                      s == ScalarType::BFloat16 || s == ScalarType::Half,
                  what, " must be float32, float64, bfloat16 or float16, got ",
                  dtype_name(s));
}

inline ScalarType lse_type(const Tensor& out) {
  return out.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

inline void check_top_k(const Tensor& map, const char* what) {
  STD_TORCH_CHECK(map.size(1) <= kMaxTopK, what, " has ", map.size(1),
                  " slots per token, more than the ", kMaxTopK, " the kernels support");
}

inline void check_permute(const Tensor& x, const Tensor& topk_idx, int64_t num_experts,
                          int64_t alignment) {
  check_dim(x, 2, "x");
  check_dim(topk_idx, 2, "topk_idx");
  STD_TORCH_CHECK(x.size(0) == topk_idx.size(0), "moe_permute needs x [T, D] and topk_idx [T, K] ",
                  "with the same T, got ", x.size(0), " and ", topk_idx.size(0), " tokens");
  STD_TORCH_CHECK(topk_idx.scalar_type() == ScalarType::Long ||
                      topk_idx.scalar_type() == ScalarType::Int,
                  "topk_idx must be int64 or int32 expert ids, got ",
                  dtype_name(topk_idx.scalar_type()));
  check_top_k(topk_idx, "topk_idx");
  STD_TORCH_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts must be in [1, ",
                  kMaxExperts, "], got ", num_experts);
  STD_TORCH_CHECK(alignment >= 1 && alignment <= kMaxAlignment, "alignment must be in [1, ",
                  kMaxAlignment, "] (1 for no padding, 128 for DeepGEMM), got ", alignment);
  check_same_device(x, "x", topk_idx, "topk_idx");
  check_contiguous(x, "x");
  check_contiguous(topk_idx, "topk_idx");
}

// rows [M, D] of a float dtype and the int64 row_map [T, K] that indexes them.
inline void check_rows_and_map(const Tensor& rows, const char* rows_name, const Tensor& row_map) {
  check_floating(rows, rows_name);
  check_dim(rows, 2, rows_name);
  check_dim(row_map, 2, "row_map");
  check_dtype(row_map, ScalarType::Long, "row_map");
  check_top_k(row_map, "row_map");
  check_same_device(rows, rows_name, row_map, "row_map");
  check_contiguous(rows, rows_name);
  check_contiguous(row_map, "row_map");
}

inline void check_weights(const Tensor& y_sorted, const Tensor& row_map, const Tensor& w) {
  check_shape(w, {row_map.size(0), row_map.size(1)}, "topk_weights", "[T, K] (row_map's) = ");
  const ScalarType y_type = y_sorted.scalar_type();
  STD_TORCH_CHECK(w.scalar_type() == ScalarType::Float || w.scalar_type() == y_type,
                  "topk_weights must be float32 or ", dtype_name(y_type),
                  " (the dtype of y_sorted), got ", dtype_name(w.scalar_type()));
  check_same_device(y_sorted, "y_sorted", w, "topk_weights");
  check_contiguous(w, "topk_weights");
}

inline void check_unpermute(const Tensor& y_sorted, const Tensor& row_map, const Tensor& w) {
  check_rows_and_map(y_sorted, "y_sorted", row_map);
  check_weights(y_sorted, row_map, w);
}

inline void check_permute_backward(const Tensor& grad_x_sorted, const Tensor& row_map) {
  check_rows_and_map(grad_x_sorted, "grad_x_sorted", row_map);
}

inline void check_unpermute_backward(const Tensor& grad_out, const Tensor& y_sorted,
                                     const Tensor& row_map, const Tensor& w) {
  check_unpermute(y_sorted, row_map, w);
  check_shape(grad_out, {row_map.size(0), y_sorted.size(1)}, "grad_out", "[T, D] = ");
  check_dtype(grad_out, y_sorted.scalar_type(), "grad_out");
  check_same_device(y_sorted, "y_sorted", grad_out, "grad_out");
  check_contiguous(grad_out, "grad_out");
}

inline void check_merge(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b,
                        const Tensor& lse_b) {
  check_floating(out_a, "out_a");
  check_dim(out_a, 3, "out_a");
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  check_shape(out_b, {tokens, heads, dim}, "out_b", "[T, H, D] (out_a's) = ");
  check_dtype(out_b, out_a.scalar_type(), "out_b");
  check_shape(lse_a, {heads, tokens}, "lse_a", "[H, T] (heads first) = ");
  check_shape(lse_b, {heads, tokens}, "lse_b", "[H, T] (heads first) = ");
  check_dtype(lse_a, lse_type(out_a), "lse_a");
  check_dtype(lse_b, lse_type(out_a), "lse_b");
  check_same_device(out_a, "out_a", lse_a, "lse_a");
  check_same_device(out_a, "out_a", out_b, "out_b");
  check_same_device(out_a, "out_a", lse_b, "lse_b");
  check_contiguous(out_a, "out_a");
  check_contiguous(lse_a, "lse_a");
  check_contiguous(out_b, "out_b");
  check_contiguous(lse_b, "lse_b");
}

inline void check_merge_backward(const Tensor& grad_out, const std::optional<Tensor>& grad_lse,
                                 const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b,
                                 const Tensor& lse_b) {
  check_merge(out_a, lse_a, out_b, lse_b);
  check_shape(grad_out, {out_a.size(0), out_a.size(1), out_a.size(2)}, "grad_out",
              "[T, H, D] (out_a's) = ");
  check_dtype(grad_out, out_a.scalar_type(), "grad_out");
  check_same_device(out_a, "out_a", grad_out, "grad_out");
  check_contiguous(grad_out, "grad_out");
  if (grad_lse.has_value()) {
    check_shape(*grad_lse, {out_a.size(1), out_a.size(0)}, "grad_lse", "[H, T] = ");
    check_dtype(*grad_lse, lse_type(out_a), "grad_lse");
    check_same_device(out_a, "out_a", *grad_lse, "grad_lse");
    check_contiguous(*grad_lse, "grad_lse");
  }
}

inline void check_quantize(const Tensor& x, int64_t block_rows, const std::string& scale_format) {
  check_floating(x, "x");
  check_dim(x, 2, "x");
  check_contiguous(x, "x");
  STD_TORCH_CHECK(block_rows == 1 || block_rows == kFp8Block,
                  "block_rows must be 1 (activations, 1x128 blocks) or 128 (weights, 128x128 "
                  "blocks), got ",
                  block_rows);
  STD_TORCH_CHECK(scale_format == "fp32" || scale_format == "ue8m0",
                  "scale_format must be 'fp32' or 'ue8m0', got '", scale_format, "'");
}

}  // namespace prime_ops
