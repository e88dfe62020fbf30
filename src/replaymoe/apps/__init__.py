"""The applications on top of the library: the ``replaymoe`` command line (:mod:`.cli`), the
rollout/replay demo (:mod:`.demo`) and the trace inspector (:mod:`.inspect`).

They use the library's public API only; the benchmarks (``replaymoe.bench``) are applications too.
"""
