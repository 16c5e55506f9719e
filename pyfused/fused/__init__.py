"""The fused (symmetric-memory) implementations of the ops' ``method="fused"``.

Importing this package has no side effect. Which function serves which op is said once, in the op
registry (pyfused/ops/registry.py, each op's ``fused``); ``pyfused.ops._fused`` imports them only
after its capability probe passed (CUDA, pyfused._C with the symmetric-memory kernels, Triton on a GPU,
a symmetric-memory backend), so ``IMPLS`` stays empty -- and ``method="fused"`` reports why --
wherever the kernels cannot run. Tests run the same functions on CPU through the "host-shm" backend
(pyfused/comm/symmetric.py) and the CPU kernels / Triton interpreter.

  all_reduce.py        custom all-reduce kernel (one-shot / two-shot), + residual + RMSNorm epilogue,
                       GEMM + all-reduce
  gemm_collectives.py  all-gather + GEMM (copy-engine pushes, per-chunk flags, Triton GEMM waits),
                       GEMM + reduce-scatter (GEMM scatters into owners' buffers, owners reduce)
  config.py            one-shot / two-shot crossover and other launch choices, as data
"""
