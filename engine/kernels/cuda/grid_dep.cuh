// Programmatic dependent launch (Hopper sm_90 and later; engine.backend launches a captured decode step's kernels
// with it, see its Kernel). Such a kernel may be scheduled while the kernel before it in its stream still runs,
// so the first statement of every kernel of the engine is GRID_DEP_ENTRY(): it waits until the previous kernel has
// finished and its writes are visible (griddepcontrol.wait), which keeps every kernel's order of reads and writes
// that of a plain launch, and then lets the next kernel be scheduled (griddepcontrol.launch_dependents). What is
// gained is the launch and block scheduling of the next kernel, done during this one's last wave instead of after
// it. Launched without the attribute (eager runs, older GPUs) both instructions return at once.
// tests/engine/test_engine_nvcc.py checks that every kernel begins with it.
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
