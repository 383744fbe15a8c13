"""nkilib.core.attention (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
