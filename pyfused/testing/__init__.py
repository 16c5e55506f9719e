"""Test beds that stand in for hardware:

  virtual_ranks.py   W ranks of the fused ops in one process, each a stream with its share of the
                     SMs (``VirtualGroup``; its ranks are ``comm.group.BufferProvider``s)
  virtual_cases.py   the fused ops as cases for them, collected from the ops' registry hooks
  interpreter.py     the Triton interpreter made safe for concurrent launches
  threaded_ranks.py  ranks as threads that run the real kernels' cross-rank protocols on CPU
  protocols.py       those protocols, rank by rank

The library never imports this package (``tests/test_import_graph.py`` and
``tests/test_interpreter_patches.py`` check it); tests, the bench suite ``virtual_ranks`` and the
sanitizer driver import it explicitly, and ``interpreter.thread_safe_interpreter()`` changes Triton
only inside its ``with`` block.
"""
