"""nkilib.core.cumsum (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
