"""What the layer families share: the tensor-parallel tile programs (:mod:`.tp_program`), the
rank-chunk pieces (:mod:`.rank_chunks`) and the base cost model the families' cost models
specialise (:mod:`.cost`)."""
