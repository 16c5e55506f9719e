"""Microbenchmark harness and CLI (``python -m pyfused.bench``; see docs/BENCH.md).

``harness`` is what suites use (BenchContext, time_fn, tflops, bandwidths, op_row, metadata,
write_results); ``cli`` discovers and runs the suites; ``launch`` starts ranks through torchrun's
machinery; ``gemm_collective`` is the shared body of the three op suites.
"""
