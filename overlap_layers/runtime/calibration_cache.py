"""Re-exports :mod:`overlap_layers.planning.calibration_cache` (the cache moved there with calibration)."""
from ..planning.calibration_cache import (FORMAT, NCCL_TRANSPORT_ENV, CalibrationCacheWarning, cache_key, cache_path,
                                          default_cache_dir, load_agreed, store)

__all__ = ["FORMAT", "NCCL_TRANSPORT_ENV", "CalibrationCacheWarning", "cache_key", "cache_path", "default_cache_dir",
           "load_agreed", "store"]
