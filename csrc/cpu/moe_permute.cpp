// MoE token permutation on CPU: prime_rl::moe_permute, moe_unpermute and their backwards.
//
// Every (token, slot) with an expert id goes to one row of an expert-contiguous buffer, in
// (token, slot) order within its expert, each expert's segment padded with zero rows to a
// multiple of `alignment`. Positions come from per-chunk histograms and a prefix sum, so the
// result does not depend on the thread count, and the sums of the unpermute run over slots in
// order (no atomics): the kernels are deterministic.
#include "../checks.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <vector>

namespace prime_ops {
namespace {

constexpr int64_t kChunk = 4096;  // (token, slot) pairs per histogram chunk

template <typename index_t>
void route(const index_t* idx, int64_t slots, int64_t top_k, int64_t num_experts,
           int64_t alignment, int64_t* row_map, int64_t* counts, int64_t* total_rows) {
  const int64_t chunks = (slots + kChunk - 1) / kChunk;
  std::vector<int64_t> hist(chunks * num_experts, 0);
  std::vector<int64_t> first_bad(chunks, -1);  // per chunk: its first slot with a bad id
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* h = hist.data() + c * num_experts;
      for (int64_t s = c * kChunk, stop = std::min(slots, s + kChunk); s < stop; ++s) {
        const int64_t e = idx[s];
        if (e >= 0 && e < num_experts) {
          ++h[e];
        } else if (e != -1 && first_bad[c] < 0) {
          first_bad[c] = s;
        }
      }
    }
  });
  for (int64_t s : first_bad) {  // the first bad slot overall: the same whatever the threads
    STD_TORCH_CHECK(s < 0, "topk_idx[", s / top_k, ", ", s % top_k, "] = ",
                    static_cast<int64_t>(idx[s]), " is outside [-1, num_experts=", num_experts,
                    "); -1 drops a slot");
  }
  // start[c * E + e]: first row of chunk c's tokens for expert e.
  std::vector<int64_t> start(chunks * num_experts);
  int64_t row = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t count = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      start[c * num_experts + e] = row + count;
      count += hist[c * num_experts + e];
    }
    counts[e] = count;
    row += (count + alignment - 1) / alignment * alignment;
  }
  *total_rows = row;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t* next = start.data() + c * num_experts;
      for (int64_t s = c * kChunk, stop = std::min(slots, s + kChunk); s < stop; ++s) {
        const int64_t e = idx[s];
        row_map[s] = e < 0 ? -1 : next[e]++;
      }
    }
  });
}

std::tuple<Tensor, Tensor, Tensor> moe_permute(Tensor x, Tensor topk_idx, int64_t num_experts,
                                               int64_t alignment) {
  check_permute(x, topk_idx, num_experts, alignment);
  const int64_t tokens = topk_idx.size(0), top_k = topk_idx.size(1), dim = x.size(1);
  const int64_t slots = tokens * top_k;
  Tensor row_map = allocate(topk_idx, {tokens, top_k}, ScalarType::Long, "row_map");
  Tensor counts = allocate(topk_idx, {num_experts}, ScalarType::Long, "tokens_per_expert");
  int64_t rows = 0;
  int64_t* map = row_map.mutable_data_ptr<int64_t>();
  int64_t* cnt = counts.mutable_data_ptr<int64_t>();
  if (topk_idx.scalar_type() == ScalarType::Long) {
    route(topk_idx.const_data_ptr<int64_t>(), slots, top_k, num_experts, alignment, map, cnt,
          &rows);
  } else {
    route(topk_idx.const_data_ptr<int32_t>(), slots, top_k, num_experts, alignment, map, cnt,
          &rows);
  }
  Tensor sorted = allocate(x, {rows, dim}, x.scalar_type(), "x_sorted");
  const size_t row_bytes = static_cast<size_t>(dim) * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(sorted.mutable_data_ptr());
  torch::stable::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t r = map[t * top_k + k];
        if (r >= 0) std::memcpy(dst + r * row_bytes, src + t * row_bytes, row_bytes);
      }
    }
  });
  if (alignment > 1) {  // zero the padding rows at the end of each expert's segment
    std::vector<int64_t> seg_end(num_experts);
    int64_t row = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      row += (cnt[e] + alignment - 1) / alignment * alignment;
      seg_end[e] = row;
    }
    torch::stable::parallel_for(0, num_experts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const int64_t pad = seg_end[e] - (e ? seg_end[e - 1] : 0) - cnt[e];
        std::memset(dst + (seg_end[e] - pad) * row_bytes, 0, pad * row_bytes);
      }
    });
  }
  return {sorted, row_map, counts};
}

// out[t] = sum over kept slots k of w[t, k] * rows[row_map[t, k]], in the accumulation type.
// Weighted sums (moe_unpermute) run in slot order, like the eager `(slots * w).sum(1)`;
// unweighted ones (moe_permute's backward, w == nullptr) run in row order, like the
// accumulating index_put that autograd runs for `x[order // K]`.
template <typename scalar_t, typename weight_t>
void gather_sum(const scalar_t* rows, const int64_t* row_map, const weight_t* w, int64_t tokens,
                int64_t top_k, int64_t dim, scalar_t* out) {
  using acc = acc_t<scalar_t>;
  torch::stable::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc> sum(dim);
    std::vector<int64_t> slots(top_k);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), acc(0));
      for (int64_t k = 0; k < top_k; ++k) slots[k] = k;
      if (w == nullptr) {
        const int64_t* map = row_map + t * top_k;
        std::sort(slots.begin(), slots.end(),
                  [&](int64_t a, int64_t b) { return map[a] < map[b]; });
      }
      for (int64_t k : slots) {
        const int64_t r = row_map[t * top_k + k];
        if (r < 0) continue;
        const scalar_t* y = rows + r * dim;
        if (w == nullptr) {
          for (int64_t d = 0; d < dim; ++d) sum[d] += static_cast<acc>(y[d]);
        } else {
          const acc wk = static_cast<acc>(w[t * top_k + k]);
          for (int64_t d = 0; d < dim; ++d) sum[d] += wk * static_cast<acc>(y[d]);
        }
      }
      scalar_t* o = out + t * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<scalar_t>(sum[d]);
    }
  });
}

// Every row_map entry in [-1, M) and no row named twice (moe_permute gives each kept slot its own
// row; the backward writes each row once). Returns which rows are used.
std::vector<char> check_row_map_values(const Tensor& row_map, int64_t rows) {
  const int64_t* map = row_map.const_data_ptr<int64_t>();
  const int64_t top_k = row_map.size(1);
  std::vector<char> used(rows, 0);
  for (int64_t s = 0, slots = row_map.numel(); s < slots; ++s) {
    const int64_t r = map[s];
    STD_TORCH_CHECK(r >= -1 && r < rows, "row_map[", s / top_k, ", ", s % top_k, "] = ", r,
                    " is outside [-1, ", rows, "), the rows of y_sorted; pass the row_map "
                    "moe_permute returned");
    if (r < 0) continue;
    STD_TORCH_CHECK(!used[r], "row_map names row ", r, " twice (again at [", s / top_k, ", ",
                    s % top_k, "]); pass the row_map moe_permute returned");
    used[r] = 1;
  }
  return used;
}

// Calls f(scalar_t{}, weight_t{}) for weights of the rows' dtype or float32.
template <typename F>
void dispatch_weights(const Tensor& rows, const Tensor& w, F&& f) {
  dispatch_floating(rows.scalar_type(), "y_sorted", [&](auto s) {
    using scalar_t = decltype(s);
    if (w.scalar_type() == rows.scalar_type()) {
      f(s, scalar_t{});
    } else {  // float32, as check_weights made sure
      f(s, float{});
    }
  });
}

Tensor moe_unpermute(Tensor y_sorted, Tensor row_map, Tensor topk_weights) {
  check_unpermute(y_sorted, row_map, topk_weights);
  check_row_map_values(row_map, y_sorted.size(0));
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = y_sorted.size(1);
  Tensor out = allocate(y_sorted, {tokens, dim}, y_sorted.scalar_type(), "out");
  dispatch_weights(y_sorted, topk_weights, [&](auto s, auto wt) {
    using scalar_t = decltype(s);
    using weight_t = decltype(wt);
    gather_sum(y_sorted.const_data_ptr<scalar_t>(), row_map.const_data_ptr<int64_t>(),
               topk_weights.const_data_ptr<weight_t>(), tokens, top_k, dim,
               out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

Tensor moe_permute_backward(Tensor grad_sorted, Tensor row_map) {
  check_permute_backward(grad_sorted, row_map);
  check_row_map_values(row_map, grad_sorted.size(0));
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = grad_sorted.size(1);
  Tensor grad_x = allocate(grad_sorted, {tokens, dim}, grad_sorted.scalar_type(), "grad_x");
  dispatch_floating(grad_sorted.scalar_type(), "grad_x_sorted", [&](auto s) {
    using scalar_t = decltype(s);
    gather_sum<scalar_t, scalar_t>(grad_sorted.const_data_ptr<scalar_t>(),
                                   row_map.const_data_ptr<int64_t>(), nullptr, tokens, top_k,
                                   dim, grad_x.mutable_data_ptr<scalar_t>());
  });
  return grad_x;
}

std::tuple<Tensor, Tensor> moe_unpermute_backward(Tensor grad_out, Tensor y_sorted,
                                                  Tensor row_map, Tensor topk_weights) {
  check_unpermute_backward(grad_out, y_sorted, row_map, topk_weights);
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = y_sorted.size(1);
  const int64_t rows = y_sorted.size(0);
  const std::vector<char> used = check_row_map_values(row_map, rows);
  Tensor grad_y = allocate(y_sorted, {rows, dim}, y_sorted.scalar_type(), "grad_y_sorted");
  Tensor grad_w =
      allocate(topk_weights, {tokens, top_k}, topk_weights.scalar_type(), "grad_topk_weights");
  const int64_t* map = row_map.const_data_ptr<int64_t>();
  dispatch_weights(y_sorted, topk_weights, [&](auto s, auto wt) {
    using scalar_t = decltype(s);
    using weight_t = decltype(wt);
    using acc = acc_t<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* y = y_sorted.const_data_ptr<scalar_t>();
    const weight_t* w = topk_weights.const_data_ptr<weight_t>();
    scalar_t* gy = grad_y.mutable_data_ptr<scalar_t>();
    weight_t* gw = grad_w.mutable_data_ptr<weight_t>();
    torch::stable::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gt = g + t * dim;
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t r = map[t * top_k + k];
          if (r < 0) {
            gw[t * top_k + k] = weight_t(0);
            continue;
          }
          const acc wk = static_cast<acc>(w[t * top_k + k]);
          const scalar_t* yr = y + r * dim;
          scalar_t* gr = gy + r * dim;
          for (int64_t d = 0; d < dim; ++d) {
            gr[d] = static_cast<scalar_t>(wk * static_cast<acc>(gt[d]));
          }
          const acc dot = lane_sum<acc>(
              dim, [&](int64_t d) { return static_cast<acc>(gt[d]) * static_cast<acc>(yr[d]); });
          gw[t * top_k + k] = static_cast<weight_t>(dot);
        }
      }
    });
    torch::stable::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (!used[r]) std::memset(gy + r * dim, 0, dim * sizeof(scalar_t));
      }
    });
  });
  return {grad_y, grad_w};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CPU, m) {
  m.impl("moe_permute", TORCH_BOX(&moe_permute));
  m.impl("moe_permute_backward", TORCH_BOX(&moe_permute_backward));
  m.impl("moe_unpermute", TORCH_BOX(&moe_unpermute));
  m.impl("moe_unpermute_backward", TORCH_BOX(&moe_unpermute_backward));
}

}  // namespace prime_ops
