// FP8 block quantisation on CUDA: the recipe of csrc/cpu/quantize_fp8.cpp, one block of 128
// threads per (row block, 128-column block), thread c owning column c of the block.
#include "cuda_common.cuh"

#include <string>
#include <tuple>

namespace prime_ops {
namespace {

constexpr int kBlock = kFp8Block;
constexpr float kFp8Max = 448.0f;

// scale (finite, positive) rounded up to a power of two (see csrc/cpu/quantize_fp8.cpp for why
// no value overflows).
__device__ __forceinline__ float pow2_ceil(float scale) {
  unsigned bits = __float_as_uint(scale);
  if (bits & 0x007fffffu) bits = (bits & 0xff800000u) + 0x00800000u;
  return __uint_as_float(bits);
}

// One block per (row block, column block); grid.y is capped at 65535, so blocks loop over
// column blocks. Non-finite blocks as on CPU: scale NaN (0x7fc00000) or inf, every code NaN.
template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* x, int64_t m, int64_t k, int64_t block_rows,
                                int64_t col_blocks, bool ue8m0, c10::Float8_e4m3fn* q,
                                float* scale) {
  __shared__ unsigned shared[kBlock / 32];
  const int64_t rb = blockIdx.x;
  const int64_t r0 = rb * block_rows, r1 = min(m, r0 + block_rows);
  for (int64_t cb = blockIdx.y; cb < col_blocks; cb += gridDim.y) {
    const int64_t c = cb * kBlock + threadIdx.x;
    // |x| compared as bits, as on CPU: NaN above inf, so any NaN wins the max.
    unsigned amax_bits = 0;
    if (c < k) {
      for (int64_t r = r0; r < r1; ++r) {
        const unsigned b = __float_as_uint(static_cast<float>(x[r * k + c])) & 0x7fffffffu;
        amax_bits = b > amax_bits ? b : amax_bits;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, offset));
    }
    __syncthreads();  // shared is still read by the previous column block
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = amax_bits;
    __syncthreads();
    amax_bits = shared[0];
    for (int w = 1; w < kBlock / 32; ++w) amax_bits = max(amax_bits, shared[w]);
    if (amax_bits >= 0x7f800000u) {  // inf or NaN
      if (threadIdx.x == 0) {
        scale[rb * col_blocks + cb] =
            __uint_as_float(amax_bits > 0x7f800000u ? 0x7fc00000u : 0x7f800000u);
      }
      if (c < k) {
        for (int64_t r = r0; r < r1; ++r) {
          q[r * k + c] = c10::Float8_e4m3fn(0x7f, c10::Float8_e4m3fn::from_bits());
        }
      }
      continue;
    }
    float amax = __uint_as_float(amax_bits);
    amax = amax < 1e-12f ? 1e-12f : amax;
    float s = __fdiv_rn(amax, kFp8Max);
    if (ue8m0) s = pow2_ceil(s);
    if (threadIdx.x == 0) scale[rb * col_blocks + cb] = s;
    if (c >= k) continue;
    for (int64_t r = r0; r < r1; ++r) {
      float v = __fdiv_rn(static_cast<float>(x[r * k + c]), s);  // IEEE division, as on CPU
      v = v < -kFp8Max ? -kFp8Max : (v > kFp8Max ? kFp8Max : v);
      q[r * k + c] = c10::Float8_e4m3fn(v);
    }
  }
}

std::tuple<Tensor, Tensor> quantize_fp8_blockwise(Tensor x, int64_t block_rows,
                                                  std::string scale_format) {
  check_quantize(x, block_rows, scale_format);
  check_cuda(x, "x");
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  cudaStream_t stream = current_stream(x);
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t row_blocks = ceil_div(m, block_rows), col_blocks = ceil_div(k, kBlock);
  Tensor q = allocate(x, {m, k}, ScalarType::Float8_e4m3fn, "q");
  Tensor scale = allocate(x, {row_blocks, col_blocks}, ScalarType::Float, "scale");
  if (row_blocks == 0 || col_blocks == 0) return {q, scale};
  check_grid(row_blocks, "quantize_fp8_blockwise (one block per row block)");
  dispatch_floating(x.scalar_type(), "x", [&](auto s) {
    using scalar_t = decltype(s);
    const dim3 grid(static_cast<unsigned>(row_blocks),
                    static_cast<unsigned>(std::min<int64_t>(col_blocks, 65535)));
    quantize_kernel<<<grid, kBlock, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), m, k, block_rows, col_blocks, scale_format == "ue8m0",
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
