"""``rmsnorm_quant_kernel`` with AWS NKI-lib's signature (``nkilib.core.rmsnorm.rmsnorm_quant``).

``rmsnorm_quant_kernel(hidden, ln_w, kargs, input_dequant_scale=None)``: optional RMSNorm
(``kargs.norm_type`` RMS_NORM / NO_NORM) then float8_e4m3 quantisation
(``kargs.quantization_type`` ROW: output [..., H + 4] with the fp32 per-row dequant scale in
the last 4 bytes; STATIC: [..., H] scaled by 1 / input_dequant_scale), ``kargs.lower_bound``
clipping (row quantisation) and ``kargs.eps``. Implementation:
:func:`torchneuron.nkilib.norm_quant.rmsnorm_quant`.
"""

from dataclasses import dataclass

import nki
import nki.language as nl
from ..utils.common_types import NormType, QuantizationType
from torchneuron.nkilib.norm_quant import rmsnorm_quant as _rmsnorm_quant

__all__ = ["RmsNormQuantKernelArgs", "rmsnorm_quant_kernel"]


@dataclass
class RmsNormQuantKernelArgs(nl.NKIObject):
    """Configuration of :func:`rmsnorm_quant_kernel` (AWS's fields and defaults)."""

    lower_bound: float = 0.0
    norm_type: NormType = NormType.RMS_NORM
    quantization_type: QuantizationType = QuantizationType.ROW
    eps: float = 1e-6

    def __post_init__(self):
        if self.quantization_type not in (QuantizationType.ROW, QuantizationType.STATIC):
            raise NotImplementedError(f"rmsnorm_quant: {self.quantization_type.name} "
                                      "quantization is not supported (ROW or STATIC)")
        if self.norm_type not in (NormType.NO_NORM, NormType.RMS_NORM):
            raise NotImplementedError(f"rmsnorm_quant: {self.norm_type.name} normalization is "
                                      "not supported (RMS_NORM or NO_NORM)")
        if self.lower_bound < 0 or self.eps < 0:
            raise ValueError(f"rmsnorm_quant: lower_bound={self.lower_bound} and eps={self.eps} "
                             "must be >= 0")

    def needs_rms_normalization(self) -> bool:
        return self.norm_type == NormType.RMS_NORM

    def is_row_quant(self) -> bool:
        return self.quantization_type == QuantizationType.ROW

    def is_static_quant(self) -> bool:
        return self.quantization_type == QuantizationType.STATIC


@nki.jit
def rmsnorm_quant_kernel(hidden, ln_w, kargs, input_dequant_scale=None):
    """RMSNorm (optional) + FP8 quantisation along the last dimension of ``hidden``."""
    return _rmsnorm_quant(hidden, ln_w, rms_norm=kargs.needs_rms_normalization(),
                          row_quant=kargs.is_row_quant(), eps=kargs.eps,
                          lower_bound=kargs.lower_bound, input_dequant_scale=input_dequant_scale)
