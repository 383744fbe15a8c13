"""Core kernels (AWS NKI-lib layout): attention, cumsum, embeddings (RoPE), rmsnorm, moe,
subkernels (rmsnorm_tkg) and utils (common_types). Submodules load on import."""
