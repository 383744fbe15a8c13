"""nkilib.core.moe (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
