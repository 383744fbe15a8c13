"""nkilib.core.rmsnorm (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
