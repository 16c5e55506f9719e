"""Test beds that stand in for hardware: the Triton interpreter made safe for concurrent launches
(``interpreter``) and ranks as threads that run the real kernels' cross-rank protocols on CPU
(``threaded_ranks``).

The library never imports this package (``tests/test_interpreter_patches.py`` checks it); tests
and harnesses import it explicitly, and ``interpreter.thread_safe_interpreter()`` changes Triton
only inside its ``with`` block.
"""
