"""The kernel layer: the Triton kernels of the fused path, their launch configs (as data) and
their launchers.

  gemm.py, gemm_configs.py, gemm_launch.py        the persistent GEMM that waits / signals /
                                                  scatters per chunk, and its fp32 reference
  reduce.py, reduce_configs.py, reduce_launch.py  the multi-source reduce + residual + RMSNorm,
                                                  pointer tables, the waits' timeout status
  grouped_gemm.py, grouped_gemm_configs.py,       the grouped GEMM over row segments (experts)
  grouped_gemm_launch.py                          that waits / signals per chunk, its reference
  bucket.py                                       the DDP / ZeRO bucket copy (its launcher is
                                                  pyfused/dp/bucket_copy.py)

The launchers import their kernels (and Triton) at their first launch. This package imports no
other pyfused package; the CUDA sources of pyfused._C are in csrc/.
"""
