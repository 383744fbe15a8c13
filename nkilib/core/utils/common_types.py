"""Enums of AWS NKI-lib's kernel arguments (``nkilib.core.utils.common_types``): the member
names and values of AWS's API."""

from enum import Enum

__all__ = ["NormType", "ActFnType", "RouterActFnType", "ExpertAffinityScaleMode",
           "QuantizationType", "QKVOutputLayout"]


class QKVOutputLayout(Enum):
    BSD = 0
    NBSd = 1
    NBdS = 2


class NormType(Enum):
    NO_NORM = 0
    RMS_NORM = 1
    LAYER_NORM = 2
    RMS_NORM_SKIP_GAMMA = 3


class ActFnType(Enum):
    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3


class RouterActFnType(Enum):
    SIGMOID = 0
    SOFTMAX = 1

    def __str__(self):
        return self.name.lower()


class ExpertAffinityScaleMode(Enum):
    NO_SCALE = 0
    POST_SCALE = 1
    PRE_SCALE = 2
    PRE_SCALE_DELAYED = 3


class QuantizationType(Enum):
    NONE = 0
    STATIC = 1
    ROW = 2
    MX = 3
    STATIC_MX = 4
    ROW_MX = 5
