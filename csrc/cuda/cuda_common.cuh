// Shared by the CUDA kernels: the current stream through the stable C shim, launch checks and
// deterministic warp/block reductions (fixed trees, no atomics on floating-point values).
#pragma once

#include "../common.h"

#include <torch/csrc/stable/accelerator.h>

#include <cuda_runtime.h>

// Declared by torch/csrc/inductor/aoti_torch/c/shim.h only when USE_CUDA is defined; exported
// by libtorch_cuda since the stable shim appeared (torch 2.9).
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                              void** ret_stream);

namespace prime_ops {

inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream) ==
                      AOTI_TORCH_SUCCESS,
                  "could not get the current CUDA stream");
  return static_cast<cudaStream_t>(stream);
}

inline void check_launch() {
  const cudaError_t err = cudaGetLastError();
  STD_TORCH_CHECK(err == cudaSuccess, "CUDA kernel launch failed: ", cudaGetErrorString(err));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = (o > v || o != o) ? o : v;  // NaN propagates, as in torch.amax
  }
  return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets the result.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

}  // namespace prime_ops
