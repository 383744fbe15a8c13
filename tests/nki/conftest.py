"""Make the repository importable (``nki``, ``torchneuron.nki``) when pytest runs from anywhere."""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("nki") is None:
    sys.path.append(_ROOT)
