// Shared by the CUDA kernels: the current stream through the stable C shim, launch and device
// checks, and deterministic warp/block reductions (fixed trees, no floating-point atomics).
#pragma once

#include "../checks.h"

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

// Every tensor of a CUDA kernel call on one GPU (checks.h compares the others with it).
inline void check_cuda(const Tensor& t, const char* what) {
  STD_TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor, got one on ", device_name(t));
}

// A grid dimension the launch accepts (x: 2^31 - 1 blocks).
inline void check_grid(int64_t blocks, const char* what) {
  STD_TORCH_CHECK(blocks < (int64_t(1) << 31), what, " needs ", blocks,
                  " CUDA blocks, more than one launch takes (2^31 - 1); split the call");
}

// Copies `bytes` written on `stream` to the host and waits for them (one host sync).
inline void read_back(void* host, const void* device, size_t bytes, cudaStream_t stream,
                      const char* op) {
  STD_TORCH_CHECK(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess,
      op, ": copy to the host failed");
  STD_TORCH_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, op, ": sync failed");
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
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
