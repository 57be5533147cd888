"""What runs a planned call on the devices: collectives and their handles (:mod:`.collectives`),
the group's host-side agreement (:mod:`.group`, :mod:`.mailbox`), the transports of rank-chunk
and MoE exchanges (:mod:`.exchange` and its two transports :mod:`.copy_engine_exchange` and
:mod:`.p2p_exchange`, :mod:`.rank_all_to_all`, :mod:`.device_all_to_all`) and the symmetric
memory they share (:mod:`.symmetric`), the
executor (:mod:`.executor`), streams and events (:mod:`.streams`), device timing
(:mod:`.timing`), SM carveout (:mod:`.carveout`) and CUDA-graph capture (:mod:`.graph_capture`).
The only place of the package (the benchmark aside) that creates CUDA streams and events."""
from .collectives import Handle, all_gather, all_reduce, all_to_all, issue, reduce_scatter
from .executor import execute
from .group import Agreement, first_disagreement, resolve_group, shared_agreement
from .streams import StreamPool

__all__ = ["Handle", "all_gather", "all_reduce", "all_to_all", "reduce_scatter", "issue",
           "execute", "Agreement", "first_disagreement", "resolve_group", "shared_agreement", "StreamPool"]
