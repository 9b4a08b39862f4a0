"""Engine kernels: each op dispatches on the array module of its inputs (cupy -> CUDA, numpy -> NumPy twin)."""
