"""What the layer families share: the tensor-parallel tile programs (:mod:`.tp_program`), the
rank-chunk pieces (:mod:`.rank_chunks`), the base cost model the families' cost models specialise
(:mod:`.cost`), the activations (:mod:`.activations`) and weight initialisation (:mod:`.init`)."""
