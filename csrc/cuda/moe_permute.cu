// MoE token permutation on CUDA: the same layout as the CPU kernel (csrc/cpu/moe_permute.cpp).
//
// Row positions come from per-chunk expert histograms, a prefix sum over (expert, chunk) and a
// rank within the chunk, so they are stable and deterministic; the output row count is read
// back once (one host sync) to allocate x_sorted. Sums run in the CPU kernel's orders, one block
// per token (no floating-point atomics).
#include "cuda_common.cuh"

#include <tuple>

namespace prime_ops {
namespace {

constexpr int kChunk = 256;  // (token, slot) pairs per chunk; one thread each

template <typename index_t>
__global__ void histogram_kernel(const index_t* idx, int64_t slots, int64_t experts,
                                 int64_t* hist, int* bad) {
  extern __shared__ int counts[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t s = blockIdx.x * int64_t(kChunk) + threadIdx.x;
  if (s < slots) {
    const int64_t e = idx[s];
    if (e >= 0 && e < experts) {
      atomicAdd(&counts[e], 1);  // integer counts: order does not matter
    } else if (e != -1) {
      *bad = 1;
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    hist[blockIdx.x * experts + e] = counts[e];
  }
}

// One block: start[c * E + e] = first row of chunk c's slots for expert e; counts; total rows.
__global__ void offsets_kernel(int64_t* start, int64_t chunks, int64_t experts, int64_t alignment,
                               int64_t* counts, int64_t* total) {
  extern __shared__ int64_t seg[];  // padded segment size per expert, then its start
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int64_t count = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t h = start[c * experts + e];
      start[c * experts + e] = count;
      count += h;
    }
    counts[e] = count;
    seg[e] = (count + alignment - 1) / alignment * alignment;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t row = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t size = seg[e];
      seg[e] = row;
      row += size;
    }
    *total = row;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    for (int64_t c = 0; c < chunks; ++c) start[c * experts + e] += seg[e];
  }
}

template <typename index_t>
__global__ void assign_kernel(const index_t* idx, int64_t slots, int64_t experts,
                              const int64_t* start, int64_t* row_map) {
  __shared__ int64_t ids[kChunk];
  const int64_t s = blockIdx.x * int64_t(kChunk) + threadIdx.x;
  const int64_t e = s < slots ? int64_t(idx[s]) : -1;
  ids[threadIdx.x] = e;
  __syncthreads();
  if (s >= slots) return;
  if (e < 0 || e >= experts) {  // an invalid id raises on the host after the sync
    row_map[s] = -1;
    return;
  }
  int64_t rank = 0;
  for (int j = 0; j < threadIdx.x; ++j) rank += ids[j] == e;
  row_map[s] = start[blockIdx.x * experts + e] + rank;
}

// One block per (token, slot): copy the token's row, in 4-byte words when rows allow it.
template <typename word_t>
__global__ void copy_rows_kernel(const word_t* x, const int64_t* row_map, int64_t top_k,
                                 int64_t words, word_t* out) {
  const int64_t s = blockIdx.x;
  const int64_t r = row_map[s];
  if (r < 0) return;
  const word_t* src = x + (s / top_k) * words;
  word_t* dst = out + r * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

template <typename index_t>
void route(const Tensor& topk_idx, int64_t experts, int64_t alignment, Tensor& row_map,
           Tensor& counts, Tensor& start, Tensor& scratch, cudaStream_t stream) {
  const int64_t slots = topk_idx.numel(), chunks = ceil_div(slots, kChunk);
  const index_t* idx = topk_idx.const_data_ptr<index_t>();
  int64_t* starts = start.mutable_data_ptr<int64_t>();
  int64_t* total = scratch.mutable_data_ptr<int64_t>();
  int* bad = reinterpret_cast<int*>(total + 1);
  histogram_kernel<<<chunks, kChunk, experts * sizeof(int), stream>>>(idx, slots, experts,
                                                                      starts, bad);
  check_launch();
  offsets_kernel<<<1, 256, experts * sizeof(int64_t), stream>>>(
      starts, chunks, experts, alignment, counts.mutable_data_ptr<int64_t>(), total);
  check_launch();
  assign_kernel<<<chunks, kChunk, 0, stream>>>(idx, slots, experts, starts,
                                               row_map.mutable_data_ptr<int64_t>());
  check_launch();
}

std::tuple<Tensor, Tensor, Tensor> moe_permute(Tensor x, Tensor topk_idx, int64_t num_experts,
                                               int64_t alignment) {
  check_permute(x, topk_idx, num_experts, alignment);
  check_cuda(x, "x");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cudaStream_t stream = current_stream(x);
  const int64_t tokens = topk_idx.size(0), top_k = topk_idx.size(1), dim = x.size(1);
  const int64_t chunks = ceil_div(tokens * top_k, kChunk);
  check_grid(tokens * top_k, "moe_permute (one block per slot of topk_idx)");
  Tensor row_map = allocate(topk_idx, {tokens, top_k}, ScalarType::Long, "row_map");
  Tensor counts = allocate(topk_idx, {num_experts}, ScalarType::Long, "tokens_per_expert", true);
  Tensor start = allocate(topk_idx, {chunks * num_experts}, ScalarType::Long, "histograms");
  Tensor scratch = allocate(topk_idx, {2}, ScalarType::Long, "row count", true);  // rows, bad
  if (tokens * top_k > 0) {
    if (topk_idx.scalar_type() == ScalarType::Long) {
      route<int64_t>(topk_idx, num_experts, alignment, row_map, counts, start, scratch, stream);
    } else {
      route<int32_t>(topk_idx, num_experts, alignment, row_map, counts, start, scratch, stream);
    }
  }
  int64_t host[2];
  read_back(host, scratch.const_data_ptr(), sizeof host, stream, "moe_permute");
  STD_TORCH_CHECK(host[1] == 0, "topk_idx holds an expert id that is outside [-1, num_experts=",
                  num_experts, "); -1 drops a slot");
  const int64_t rows = host[0];
  Tensor sorted = allocate(x, {rows, dim}, x.scalar_type(), "x_sorted", alignment > 1);
  const int64_t row_bytes = dim * static_cast<int64_t>(x.element_size());
  if (tokens * top_k > 0 && row_bytes > 0) {
    const int threads = 128;
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; };
    if (row_bytes % 4 == 0 && aligned(x.const_data_ptr()) && aligned(sorted.const_data_ptr())) {
      copy_rows_kernel<<<tokens * top_k, threads, 0, stream>>>(
          static_cast<const uint32_t*>(x.const_data_ptr()), row_map.const_data_ptr<int64_t>(),
          top_k, row_bytes / 4, static_cast<uint32_t*>(sorted.mutable_data_ptr()));
    } else {
      copy_rows_kernel<<<tokens * top_k, threads, 0, stream>>>(
          static_cast<const uint8_t*>(x.const_data_ptr()), row_map.const_data_ptr<int64_t>(),
          top_k, row_bytes, static_cast<uint8_t*>(sorted.mutable_data_ptr()));
    }
    check_launch();
  }
  return {sorted, row_map, counts};
}

// flags[0]: an entry outside [-1, rows); flags[1]: a row named twice (seen[r] counts uses).
__global__ void row_map_kernel(const int64_t* row_map, int64_t slots, int64_t rows, int* seen,
                               int* flags) {
  const int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (s >= slots) return;
  const int64_t r = row_map[s];
  if (r < -1 || r >= rows) {
    atomicOr(&flags[0], 1);
  } else if (r >= 0 && atomicAdd(&seen[r], 1) != 0) {
    atomicOr(&flags[1], 1);
  }
}

// The CPU kernels' row_map check on the GPU (one host sync): every entry in [-1, rows), no row
// named twice. The kernels below index rows only after it passed.
void check_row_map_values(const Tensor& rows, const Tensor& row_map, cudaStream_t stream,
                          const char* op) {
  const int64_t slots = row_map.numel(), n = rows.size(0);
  if (slots == 0) return;
  Tensor seen = allocate(rows, {n + 2}, ScalarType::Int, "row_map check", true);
  int* flags = seen.mutable_data_ptr<int>() + n;
  row_map_kernel<<<ceil_div(slots, 256), 256, 0, stream>>>(row_map.const_data_ptr<int64_t>(),
                                                            slots, n, seen.mutable_data_ptr<int>(),
                                                            flags);
  check_launch();
  int32_t host[2];
  read_back(host, flags, sizeof host, stream, op);
  STD_TORCH_CHECK(!host[0], "row_map holds an entry outside [-1, ", n,
                  "), the rows of y_sorted; pass the row_map moe_permute returned");
  STD_TORCH_CHECK(!host[1], "row_map names a row twice; pass the row_map moe_permute returned");
}

// One block per token: out[t] = sum_k w[t, k] * rows[row_map[t, k]]. Weighted sums run in slot
// order, unweighted ones (moe_permute's backward) in row order, as on CPU.
template <typename scalar_t, typename weight_t>
__global__ void gather_sum_kernel(const scalar_t* rows, const int64_t* row_map,
                                  const weight_t* w, int64_t top_k, int64_t dim, scalar_t* out) {
  using acc = acc_t<scalar_t>;
  extern __shared__ int64_t order[];  // this token's rows in summation order
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int64_t k = 0; k < top_k; ++k) {
      int64_t r = row_map[t * top_k + k], j = k;
      for (; w == nullptr && j > 0 && order[j - 1] > r; --j) order[j] = order[j - 1];
      order[j] = r;
    }
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    acc sum = 0;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t r = order[k];
      if (r < 0) continue;
      const acc wk = w == nullptr ? acc(1) : static_cast<acc>(w[t * top_k + k]);
      sum += wk * static_cast<acc>(rows[r * dim + d]);
    }
    out[t * dim + d] = static_cast<scalar_t>(sum);
  }
}

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
  check_cuda(y_sorted, "y_sorted");
  torch::stable::accelerator::DeviceGuard guard(y_sorted.get_device_index());
  cudaStream_t stream = current_stream(y_sorted);
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = y_sorted.size(1);
  check_grid(tokens, "moe_unpermute (one block per token)");
  check_row_map_values(y_sorted, row_map, stream, "moe_unpermute");
  Tensor out = allocate(y_sorted, {tokens, dim}, y_sorted.scalar_type(), "out");
  if (tokens == 0 || dim == 0) return out;
  dispatch_weights(y_sorted, topk_weights, [&](auto s, auto wt) {
    using scalar_t = decltype(s);
    using weight_t = decltype(wt);
    gather_sum_kernel<<<tokens, 128, top_k * sizeof(int64_t), stream>>>(
        y_sorted.const_data_ptr<scalar_t>(), row_map.const_data_ptr<int64_t>(),
        topk_weights.const_data_ptr<weight_t>(), top_k, dim, out.mutable_data_ptr<scalar_t>());
    check_launch();
  });
  return out;
}

Tensor moe_permute_backward(Tensor grad_sorted, Tensor row_map) {
  check_permute_backward(grad_sorted, row_map);
  check_cuda(grad_sorted, "grad_x_sorted");
  torch::stable::accelerator::DeviceGuard guard(grad_sorted.get_device_index());
  cudaStream_t stream = current_stream(grad_sorted);
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = grad_sorted.size(1);
  check_grid(tokens, "moe_permute_backward (one block per token)");
  check_row_map_values(grad_sorted, row_map, stream, "moe_permute_backward");
  Tensor grad_x = allocate(grad_sorted, {tokens, dim}, grad_sorted.scalar_type(), "grad_x");
  if (tokens == 0 || dim == 0) return grad_x;
  dispatch_floating(grad_sorted.scalar_type(), "grad_x_sorted", [&](auto s) {
    using scalar_t = decltype(s);
    gather_sum_kernel<scalar_t, scalar_t><<<tokens, 128, top_k * sizeof(int64_t), stream>>>(
        grad_sorted.const_data_ptr<scalar_t>(), row_map.const_data_ptr<int64_t>(), nullptr,
        top_k, dim, grad_x.mutable_data_ptr<scalar_t>());
    check_launch();
  });
  return grad_x;
}

// One block per token: scatter w * g into each kept slot's row, and <g, y[row]> per slot.
template <typename scalar_t, typename weight_t>
__global__ void unpermute_backward_kernel(const scalar_t* g, const scalar_t* y,
                                          const int64_t* row_map, const weight_t* w,
                                          int64_t top_k, int64_t dim, scalar_t* grad_y,
                                          weight_t* grad_w) {
  using acc = acc_t<scalar_t>;
  __shared__ acc shared[32];
  const int64_t t = blockIdx.x;
  for (int64_t k = 0; k < top_k; ++k) {
    const int64_t r = row_map[t * top_k + k];  // the same for every thread: no divergence
    if (r < 0) {
      if (threadIdx.x == 0) grad_w[t * top_k + k] = weight_t(0);
      continue;
    }
    const acc wk = static_cast<acc>(w[t * top_k + k]);
    acc dot = 0;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const acc gd = static_cast<acc>(g[t * dim + d]);
      grad_y[r * dim + d] = static_cast<scalar_t>(wk * gd);
      dot += gd * static_cast<acc>(y[r * dim + d]);
    }
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) grad_w[t * top_k + k] = static_cast<weight_t>(dot);
  }
}

std::tuple<Tensor, Tensor> moe_unpermute_backward(Tensor grad_out, Tensor y_sorted,
                                                  Tensor row_map, Tensor topk_weights) {
  check_unpermute_backward(grad_out, y_sorted, row_map, topk_weights);
  check_cuda(y_sorted, "y_sorted");
  torch::stable::accelerator::DeviceGuard guard(y_sorted.get_device_index());
  cudaStream_t stream = current_stream(y_sorted);
  const int64_t tokens = row_map.size(0), top_k = row_map.size(1), dim = y_sorted.size(1);
  check_grid(tokens, "moe_unpermute_backward (one block per token)");
  check_row_map_values(y_sorted, row_map, stream, "moe_unpermute_backward");
  Tensor grad_y = allocate(y_sorted, {y_sorted.size(0), dim}, y_sorted.scalar_type(),
                           "grad_y_sorted", true);  // padding rows stay 0
  Tensor grad_w = allocate(topk_weights, {tokens, top_k}, topk_weights.scalar_type(),
                           "grad_topk_weights", true);
  if (tokens == 0 || top_k == 0) return {grad_y, grad_w};
  dispatch_weights(y_sorted, topk_weights, [&](auto s, auto wt) {
    using scalar_t = decltype(s);
    using weight_t = decltype(wt);
    unpermute_backward_kernel<<<tokens, 128, 0, stream>>>(
        grad_out.const_data_ptr<scalar_t>(), y_sorted.const_data_ptr<scalar_t>(),
        row_map.const_data_ptr<int64_t>(), topk_weights.const_data_ptr<weight_t>(), top_k, dim,
        grad_y.mutable_data_ptr<scalar_t>(), grad_w.mutable_data_ptr<weight_t>());
    check_launch();
  });
  return {grad_y, grad_w};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CUDA, m) {
  m.impl("moe_permute", TORCH_BOX(&moe_permute));
  m.impl("moe_permute_backward", TORCH_BOX(&moe_permute_backward));
  m.impl("moe_unpermute", TORCH_BOX(&moe_unpermute));
  m.impl("moe_unpermute_backward", TORCH_BOX(&moe_unpermute_backward));
}

}  // namespace prime_ops
