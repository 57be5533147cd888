"""The package's Triton kernels, each module with its launch wrappers and the torch reference the
kernels must equal (the path that runs where Triton does not: CPU installs, float64), and the
gate saying where Triton runs (:mod:`.triton_gate`). Nothing here knows the layers, the planner
or the collectives: the layers and the runtime's transports call these functions."""
