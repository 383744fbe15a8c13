"""nkilib.core.subkernels (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
