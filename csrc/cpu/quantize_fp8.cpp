// FP8 block quantisation on CPU: prime_rl::quantize_fp8_blockwise.
//
// x [M, K] -> q float8_e4m3fn [M, K] and one fp32 scale per block_rows x 128 block, scales
// [ceil(M / block_rows), ceil(K / 128)] (DeepGEMM's operand layout before its own TMA
// transform; block_rows 1 for activations, 128 for weights). scale = amax / 448 (amax clamped
// to 1e-12), q = clamp(x / scale, -448, 448). With ue8m0 the scale is rounded UP to a power of
// two (what SM100 kernels read as UE8M0), so |x / scale| <= 448 still holds. x is read as
// float32 first (a float64 beyond float32's range becomes inf). A block holding NaN gets the
// scale NaN (0x7fc00000), one holding +-inf and no NaN the scale inf, and every code of such a
// block is NaN (0x7f): it dequantizes to NaN, never to finite values.
#include "../checks.h"

#include <cmath>
#include <cstring>
#include <tuple>

namespace prime_ops {
namespace {

constexpr int64_t kBlock = kFp8Block;
constexpr float kFp8Max = 448.0f;

// scale rounded up to a power of two. amax / p <= 448 follows: fl(amax / 448) never rounds down
// onto a power of two (448 = 7 * 2^6 leaves a relative gap of at least 2^-23.8 > half an ulp).
inline float pow2_ceil(float scale) {  // scale finite and positive
  uint32_t bits;
  std::memcpy(&bits, &scale, sizeof bits);
  if (bits & 0x007fffffu) bits = (bits & 0xff800000u) + 0x00800000u;
  float p;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// float -> float8_e4m3fn bits, round to nearest even, bit-identical to c10::Float8_e4m3fn(f) for
// |f| <= 448 and NaN (the only inputs after the clamp). Both rounding paths are computed and one
// selected, so the loop vectorises.
inline uint8_t e4m3fn_bits(float f) {
  const uint32_t all = bits_of(f), sign = all & 0x80000000u, mag = all ^ sign;
  constexpr uint32_t kDenormMagic = 141u << 23;  // adding 2^-6 * 2^3 rounds to a denormal step
  const uint32_t denormal = bits_of(float_of(mag) + float_of(kDenormMagic)) - kDenormMagic;
  const uint32_t normal = (mag + (uint32_t(7 - 127) << 23) + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
  uint32_t r = mag < (121u << 23) ? denormal : normal;
  r = mag > 0x7f800000u ? 0x7fu : r;  // NaN stays NaN
  return static_cast<uint8_t>(r | (sign >> 24));
}

template <typename scalar_t>
void quantize_block(const scalar_t* x, int64_t k, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    bool ue8m0, uint8_t* q, float* scale) {
  // |x| compared as integers: the order of non-negative floats, with NaN above inf, so a NaN
  // propagates as in torch.amax and the reduction vectorises.
  uint32_t amax_bits = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* row = x + r * k;
    for (int64_t c = c0; c < c1; ++c) {
      const uint32_t b = bits_of(static_cast<float>(row[c])) & 0x7fffffffu;
      amax_bits = b > amax_bits ? b : amax_bits;
    }
  }
  if (amax_bits >= 0x7f800000u) {  // inf or NaN: the block's codes carry no information
    *scale = amax_bits > 0x7f800000u ? float_of(0x7fc00000u) : float_of(0x7f800000u);
    for (int64_t r = r0; r < r1; ++r) std::memset(q + r * k + c0, 0x7f, c1 - c0);
    return;
  }
  float amax = float_of(amax_bits);
  amax = amax < 1e-12f ? 1e-12f : amax;
  float s = amax / kFp8Max;
  if (ue8m0) s = pow2_ceil(s);
  *scale = s;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* row = x + r * k;
    uint8_t* out = q + r * k;
    for (int64_t c = c0; c < c1; ++c) {
      float v = static_cast<float>(row[c]) / s;
      v = v < -kFp8Max ? -kFp8Max : (v > kFp8Max ? kFp8Max : v);
      out[c] = e4m3fn_bits(v);
    }
  }
}

std::tuple<Tensor, Tensor> quantize_fp8_blockwise(Tensor x, int64_t block_rows,
                                                  std::string scale_format) {
  check_quantize(x, block_rows, scale_format);
  const bool ue8m0 = scale_format == "ue8m0";
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  const int64_t col_blocks = (k + kBlock - 1) / kBlock;
  Tensor q = allocate(x, {m, k}, ScalarType::Float8_e4m3fn, "q");
  Tensor scale = allocate(x, {row_blocks, col_blocks}, ScalarType::Float, "scale");
  dispatch_floating(x.scalar_type(), "x", [&](auto s) {
    using scalar_t = decltype(s);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    auto* qp = static_cast<uint8_t*>(q.mutable_data_ptr());
    float* sp = scale.mutable_data_ptr<float>();
    const int64_t grain = block_rows == 1 ? 16 : 1;
    torch::stable::parallel_for(0, row_blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t rb = begin; rb < end; ++rb) {
        const int64_t r0 = rb * block_rows, r1 = std::min(m, r0 + block_rows);
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
          const int64_t c0 = cb * kBlock, c1 = std::min(k, c0 + kBlock);
          quantize_block(xp, k, r0, r1, c0, c1, ue8m0, qp, sp + rb * col_blocks + cb);
        }
      }
    });
  });
  return {q, scale};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(prime_rl, CPU, m) {
  m.impl("quantize_fp8_blockwise", TORCH_BOX(&quantize_fp8_blockwise));
}

}  // namespace prime_ops
