"""Make the repository importable (``nkilib``, ``torchneuron.nkilib``) from anywhere."""

import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("nkilib") is None:
    sys.path.append(_ROOT)
