"""Models and variants of the whole-model benchmark (``python -m overlap_layers.bench.model``):
shape presets (:mod:`.presets`), a torchtitan-style decoder and its parallel forms (:mod:`.titan`),
transformers' models with their own TP plan and a torch expert-parallel MoE (:mod:`.hf`), the
variants built from one dense model (:mod:`.variants`), and the outputs (:mod:`.report`)."""
