// Programmatic dependent launch (Hopper sm_90 and later; engine.backend launches a captured decode step's kernels
// with it, see its Kernel). Such a kernel may be scheduled while the kernel before it in its stream still runs,
// so every kernel of the engine executes GRID_DEP_ENTRY() before its first load or store: it waits until the
// previous kernel has finished and its writes are visible (griddepcontrol.wait), which keeps every kernel's order
// of reads and writes that of a plain launch, and then lets the next kernel be scheduled
// (griddepcontrol.launch_dependents). What is gained is the launch and block scheduling of the next kernel, done
// during this one's last wave instead of after it. Launched without the attribute (eager runs, older GPUs) both
// instructions return at once.
//
// Only L2 prefetches of a kernel's weights may come before the entry (grid_dep_prefetch_*): a block scheduled
// early then pulls its first weight bytes from DRAM while the previous kernel finishes, which a decode step of
// small, latency-bound kernels otherwise leaves idle. A prefetch is a hint that loads nothing into registers or
// L1 and L2 is the GPU's point of coherence, so it cannot make a later load see stale data; its arguments come
// from kernel parameters and the block index only (no load before the wait). QWEN4EXP_NO_PREFETCH (a compile
// definition, set by engine.backend from QWEN4EXP_PREFETCH=0) turns the prefetches off.
// tests/engine/test_engine_nvcc.py checks that every kernel begins with the entry, after prefetches only.
#pragma once

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define GRID_DEP_ENTRY()                                      \
    do {                                                      \
        asm volatile("griddepcontrol.wait;" ::: "memory");    \
        asm volatile("griddepcontrol.launch_dependents;" ::); \
    } while (0)
#else
#define GRID_DEP_ENTRY() \
    do {                 \
    } while (0)
#endif

// Bytes one block prefetches at most: blocks resident at once (~1,000 on 132 SMs) x 32 KB stays well inside the
// 50 MB L2, so lines are not evicted before the block that asked for them reads them.
#ifndef GRID_DEP_PREFETCH_MAX
#define GRID_DEP_PREFETCH_MAX 32768
#endif

// L2 prefetch of `count` spans of `bytes` each, `stride` bytes apart from `p` (the block's threads share the
// 128-byte lines; at most GRID_DEP_PREFETCH_MAX bytes in all). A 1-D block; sm_90+ only (where the entry waits).
__device__ __forceinline__ void grid_dep_prefetch_spans(const void* p, long long bytes, int count, long long stride) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && !defined(QWEN4EXP_NO_PREFETCH)
    long long budget = GRID_DEP_PREFETCH_MAX;
    for (int s = 0; s < count && budget > 0; ++s) {
        const long long n = bytes < budget ? bytes : budget;
        const char* c = static_cast<const char*>(p) + s * stride;
        for (long long off = (long long)threadIdx.x * 128; off < n; off += (long long)blockDim.x * 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
        budget -= n;
    }
#endif
}

// The rows [blockIdx.x * rows, min(N, +rows)) of a dense row-major weight with `row_bytes` bytes a row, when
// `dense` (a grouped launch's experts come from tables the previous kernel writes: not known before the wait) and
// for grid row 0 only (the other grid rows read the same weights). `streams` > 1: the same rows of that many
// weights of N rows each, `stream_bytes` apart (the hyper-connection's up weight, one block of rows per stream).
__device__ __forceinline__ void grid_dep_prefetch_rows(const void* w, int rows, int N, long long row_bytes, bool dense,
                                                       int streams = 1, long long stream_bytes = 0) {
    const long long r0 = (long long)blockIdx.x * rows;
    if (!dense || blockIdx.y != 0 || r0 >= N) return;
    const long long r1 = r0 + rows < N ? r0 + rows : N;
    grid_dep_prefetch_spans(static_cast<const char*>(w) + r0 * row_bytes, (r1 - r0) * row_bytes, streams,
                            stream_bytes);
}
