// Attention-state merge on CUDA: the formulas of csrc/cpu/merge_attn_states.cpp, one warp per
// (token, head) row; the backward's dot products are warp reductions (fixed order).
#include "cuda_common.cuh"

#include <cmath>
#include <tuple>

namespace prime_ops {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename acc>
__device__ __forceinline__ void weights(acc la, acc lb, acc* lse, acc* wa, acc* wb) {
  if (isinf(la) && la == lb) {
    *lse = la;
  } else {
    *lse = (la > lb ? la : lb) + log1p(exp(-fabs(la - lb)));
  }
  const acc finite = *lse == -INFINITY ? acc(0) : *lse;
  *wa = exp(la - finite);
  *wb = exp(lb - finite);
}

template <typename scalar_t>
__global__ void merge_kernel(const scalar_t* oa, const acc_t<scalar_t>* la, const scalar_t* ob,
                             const acc_t<scalar_t>* lb, int64_t tokens, int64_t heads,
                             int64_t dim, scalar_t* out, acc_t<scalar_t>* lse) {
  using acc = acc_t<scalar_t>;
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= tokens * heads) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = row / heads, h = row % heads, i = h * tokens + t;
  acc l, wa, wb;
  weights(la[i], lb[i], &l, &wa, &wb);
  if (lane == 0) lse[i] = l;
  for (int64_t d = lane; d < dim; d += 32) {
    const acc pa = wa * static_cast<acc>(oa[row * dim + d]);
    const acc pb = wb * static_cast<acc>(ob[row * dim + d]);
    out[row * dim + d] = static_cast<scalar_t>(pa + pb);
  }
}

template <typename scalar_t>
__global__ void merge_backward_kernel(const scalar_t* g, const acc_t<scalar_t>* gl,
                                      const scalar_t* oa, const acc_t<scalar_t>* la,
                                      const scalar_t* ob, const acc_t<scalar_t>* lb,
                                      int64_t tokens, int64_t heads, int64_t dim,
                                      scalar_t* goa, acc_t<scalar_t>* gla, scalar_t* gob,
                                      acc_t<scalar_t>* glb) {
  using acc = acc_t<scalar_t>;
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  if (row >= tokens * heads) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = row / heads, h = row % heads, i = h * tokens + t;
  acc l, wa, wb;
  weights(la[i], lb[i], &l, &wa, &wb);
  acc dot_a = 0, dot_b = 0;
  for (int64_t d = lane; d < dim; d += 32) {
    const acc gd = static_cast<acc>(g[row * dim + d]);
    const acc a = static_cast<acc>(oa[row * dim + d]);
    const acc b = static_cast<acc>(ob[row * dim + d]);
    const acc merged = wa * a + wb * b;
    dot_a += gd * (a - merged);
    dot_b += gd * (b - merged);
    goa[row * dim + d] = static_cast<scalar_t>(gd * wa);
    gob[row * dim + d] = static_cast<scalar_t>(gd * wb);
  }
  dot_a = warp_sum(dot_a);
  dot_b = warp_sum(dot_b);
  if (lane == 0) {
    const acc g_lse = gl == nullptr ? acc(0) : gl[i];
    gla[i] = wa * (dot_a + g_lse);
    glb[i] = wb * (dot_b + g_lse);
  }
}

int64_t blocks_for(int64_t rows) { return ceil_div(rows, kWarpsPerBlock); }

std::tuple<Tensor, Tensor> merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b,
                                             Tensor lse_b) {
  check_merge(out_a, lse_a, out_b, lse_b);
  check_cuda(out_a, "out_a");
  torch::stable::accelerator::DeviceGuard guard(out_a.get_device_index());
  cudaStream_t stream = current_stream(out_a);
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  check_grid(blocks_for(tokens * heads), "merge_attn_states");
  Tensor out = allocate(out_a, {tokens, heads, dim}, out_a.scalar_type(), "out");
  Tensor lse = allocate(lse_a, {heads, tokens}, lse_a.scalar_type(), "lse");
  if (tokens * heads == 0) return {out, lse};
  dispatch_floating(out_a.scalar_type(), "out_a", [&](auto s) {
    using scalar_t = decltype(s);
    using acc = acc_t<scalar_t>;
    merge_kernel<<<blocks_for(tokens * heads), 32 * kWarpsPerBlock, 0, stream>>>(
        out_a.const_data_ptr<scalar_t>(), lse_a.const_data_ptr<acc>(),
        out_b.const_data_ptr<scalar_t>(), lse_b.const_data_ptr<acc>(), tokens, heads, dim,
        out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<acc>());
    check_launch();
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> merge_attn_states_backward(
    Tensor grad_out, std::optional<Tensor> grad_lse, Tensor out_a, Tensor lse_a, Tensor out_b,
    Tensor lse_b) {
  check_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b);
  check_cuda(out_a, "out_a");
  torch::stable::accelerator::DeviceGuard guard(out_a.get_device_index());
  cudaStream_t stream = current_stream(out_a);
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  check_grid(blocks_for(tokens * heads), "merge_attn_states_backward");
  const ScalarType type = out_a.scalar_type(), acc_type = lse_a.scalar_type();
  Tensor grad_oa = allocate(out_a, {tokens, heads, dim}, type, "grad_out_a");
  Tensor grad_ob = allocate(out_b, {tokens, heads, dim}, type, "grad_out_b");
  Tensor grad_la = allocate(lse_a, {heads, tokens}, acc_type, "grad_lse_a");
  Tensor grad_lb = allocate(lse_b, {heads, tokens}, acc_type, "grad_lse_b");
  if (tokens * heads == 0) return {grad_oa, grad_la, grad_ob, grad_lb};
  dispatch_floating(out_a.scalar_type(), "out_a", [&](auto s) {
    using scalar_t = decltype(s);
    using acc = acc_t<scalar_t>;
    merge_backward_kernel<<<blocks_for(tokens * heads), 32 * kWarpsPerBlock, 0, stream>>>(
        grad_out.const_data_ptr<scalar_t>(),
        grad_lse.has_value() ? grad_lse->const_data_ptr<acc>() : nullptr,
        out_a.const_data_ptr<scalar_t>(), lse_a.const_data_ptr<acc>(),
        out_b.const_data_ptr<scalar_t>(), lse_b.const_data_ptr<acc>(), tokens, heads, dim,
        grad_oa.mutable_data_ptr<scalar_t>(), grad_la.mutable_data_ptr<acc>(),
        grad_ob.mutable_data_ptr<scalar_t>(), grad_lb.mutable_data_ptr<acc>());
    check_launch();
  });
  return {grad_oa, grad_la, grad_ob, grad_lb};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CUDA, m) {
  m.impl("merge_attn_states", TORCH_BOX(&merge_attn_states));
  m.impl("merge_attn_states_backward", TORCH_BOX(&merge_attn_states_backward));
}

}  // namespace prime_ops
