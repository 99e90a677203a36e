"""Lower-precision training: FP8 (`quantization.fp8`), applied to a model's blocks by its parallelize plan."""
