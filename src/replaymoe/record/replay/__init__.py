"""Feed recorded routing back into a forward pass.

:class:`ReplaySource` turns one :class:`~replaymoe.record.trace.RoutingTrace` per sequence of a batch
into the per-layer ``replay_ids`` that :func:`replaymoe.route` / :func:`replaymoe.fused_moe`
take. Rows it cannot fill (padding, a position the trace does not cover, a row recorded as
missing) come back as all -1, which the routing kernels treat as "route this token natively";
the source counts those per layer so a trainer can tell how much of a batch was really replayed::

    src = ReplaySource([trace_a, trace_b])            # one trace per sequence
    src.check_model(num_layers=48, top_k=8, num_experts=128)
    for layer in range(48):
        ids = src.ids_for(layer, positions)           # int32 [B*S, K] on positions.device
        out = route(logits[layer], 8, replay_ids=ids)
    print(src.report())

``ids_for`` is a pure device gather (no host synchronisation, fixed shapes), so it can run
inside a CUDA graph once :meth:`ReplaySource.prepare` has put the tables on the device.

:class:`ReplayTable` is the one device table behind every replay: ``ReplaySource`` looks its rows up by
batch row and position, and the transformers integration (:mod:`replaymoe.hf`) by batch row or by
content (each token's prefix hash: :func:`prefix_hashes`), all layers with one gather per forward.
Its :meth:`~ReplayTable.lookup` picks the producer of a forward's ids (a torch gather here, or a
caller's device kernel handed :meth:`~ReplayTable.kernel_args`), so no caller reads the table's layout.

The work is split by role, in modules that import one way only (``hashes`` <- ``packing`` <- ``table``
<- ``source``): :mod:`~replaymoe.record.replay.hashes` the prefix hashes (content matching),
:mod:`~replaymoe.record.replay.packing` a load's host arrays (the packed rows, the sorted content
index), :mod:`~replaymoe.record.replay.table` :class:`ReplayTable` and :class:`ReplayReport`, and
:mod:`~replaymoe.record.replay.source` :class:`ReplaySource`; the public names are imported from here.
"""

from __future__ import annotations

from .hashes import prefix_hashes, prefix_hashes_np
from .source import ReplaySource
from .table import MISSING_MODES, REPLAY_MODES, ReplayReport, ReplayTable

__all__ = [
    "MISSING_MODES",
    "REPLAY_MODES",
    "ReplaySource",
    "ReplayReport",
    "ReplayTable",
    "prefix_hashes",
    "prefix_hashes_np",
]
