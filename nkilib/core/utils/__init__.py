"""nkilib.core.utils (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
