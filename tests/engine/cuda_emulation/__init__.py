"""Check `mx.fast.cuda_kernel` sources without a GPU: NVRTC compile check, CPU emulation."""
