"""The per-layer benchmark (``python -m overlap_layers.bench``)."""
