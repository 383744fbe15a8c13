"""``RoPE`` with AWS NKI-lib's signature (``nkilib.core.embeddings.rope``): rotary position
embedding of ``x_in`` (d_head, B, n_heads, S) with ``cos`` / ``sin`` (d_head/2, B, S); see
:func:`torchneuron.nkilib.rotary.rope_dbhs` (``lnc_shard`` splits S across the LNC's
cores; ``contiguous_layout=False`` rotates interleaved pairs)."""

from torchneuron.nkilib.rotary import rope_dbhs as RoPE  # noqa: N812  (AWS's name)

__all__ = ["RoPE"]
