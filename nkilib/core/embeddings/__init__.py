"""nkilib.core.embeddings (AWS NKI-lib layout; implementations in torchneuron.nkilib)."""
