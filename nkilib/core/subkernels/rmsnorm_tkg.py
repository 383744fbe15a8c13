"""``rmsnorm_tkg`` with AWS NKI-lib's signature (``nkilib.core.subkernels.rmsnorm_tkg``):
see :mod:`torchneuron.nkilib.norm_tkg` for the output layouts (LNC=1 / LNC=2 /
hidden_dim_tp), token sharding and ``shard_on_h``."""

from torchneuron.nkilib.norm_tkg import rmsnorm_tkg

__all__ = ["rmsnorm_tkg"]
