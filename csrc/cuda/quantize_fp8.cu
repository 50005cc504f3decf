// FP8 block quantisation on CUDA: the recipe of csrc/cpu/quantize_fp8.cpp, one block of 128
// threads per (row block, 128-column block), thread c owning column c of the block.
#include "cuda_common.cuh"

#include <string>
#include <tuple>

namespace prime_ops {
namespace {

constexpr int kBlock = 128;
constexpr float kFp8Max = 448.0f;

// scale rounded up to a power of two (see csrc/cpu/quantize_fp8.cpp for why no value overflows).
__device__ __forceinline__ float pow2_ceil(float scale) {
  unsigned bits = __float_as_uint(scale);
  if ((bits & 0x7f800000u) == 0x7f800000u) return scale;
  if (bits & 0x007fffffu) bits = (bits & 0xff800000u) + 0x00800000u;
  return __uint_as_float(bits);
}

template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* x, int64_t m, int64_t k, int64_t block_rows,
                                bool ue8m0, c10::Float8_e4m3fn* q, float* scale) {
  __shared__ float shared[kBlock / 32];
  const int64_t rb = blockIdx.x, cb = blockIdx.y, col_blocks = gridDim.y;
  const int64_t r0 = rb * block_rows, r1 = min(m, r0 + block_rows);
  const int64_t c = cb * kBlock + threadIdx.x;
  float amax = 0.0f;
  if (c < k) {
    for (int64_t r = r0; r < r1; ++r) {
      const float a = fabsf(static_cast<float>(x[r * k + c]));
      amax = (a > amax || a != a) ? a : amax;
    }
  }
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = shared[0];
  for (int w = 1; w < kBlock / 32; ++w) {
    amax = (shared[w] > amax || shared[w] != shared[w]) ? shared[w] : amax;
  }
  amax = amax < 1e-12f ? 1e-12f : amax;
  float s = __fdiv_rn(amax, kFp8Max);
  if (ue8m0) s = pow2_ceil(s);
  if (threadIdx.x == 0) scale[rb * col_blocks + cb] = s;
  if (c >= k) return;
  for (int64_t r = r0; r < r1; ++r) {
    float v = __fdiv_rn(static_cast<float>(x[r * k + c]), s);  // IEEE division, as on CPU
    v = v < -kFp8Max ? -kFp8Max : (v > kFp8Max ? kFp8Max : v);
    q[r * k + c] = c10::Float8_e4m3fn(v);
  }
}

std::tuple<Tensor, Tensor> quantize_fp8_blockwise(Tensor x, int64_t block_rows,
                                                  std::string scale_format) {
  check_dim(x, 2, "x");
  check_contiguous(x, "x");
  STD_TORCH_CHECK(block_rows == 1 || block_rows == kBlock, "block_rows must be 1 or 128");
  STD_TORCH_CHECK(scale_format == "fp32" || scale_format == "ue8m0",
                  "scale_format must be 'fp32' or 'ue8m0'");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cudaStream_t stream = current_stream(x);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t row_blocks = ceil_div(m, block_rows), col_blocks = ceil_div(k, kBlock);
  Tensor q = torch::stable::new_empty(x, {m, k}, ScalarType::Float8_e4m3fn);
  Tensor scale = torch::stable::new_empty(x, {row_blocks, col_blocks}, ScalarType::Float);
  if (row_blocks == 0 || col_blocks == 0) return {q, scale};
  STD_TORCH_CHECK(col_blocks < 65536, "quantize_fp8_blockwise: x has too many columns");
  dispatch_floating(x.scalar_type(), "x", [&](auto s) {
    using scalar_t = decltype(s);
    const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_blocks));
    quantize_kernel<<<grid, kBlock, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), m, k, block_rows, scale_format == "ue8m0",
        static_cast<c10::Float8_e4m3fn*>(q.mutable_data_ptr()), scale.mutable_data_ptr<float>());
    check_launch();
  });
  return {q, scale};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CUDA, m) {
  m.impl("quantize_fp8_blockwise", TORCH_BOX(&quantize_fp8_blockwise));
}

}  // namespace prime_ops
