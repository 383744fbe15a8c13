"""``nkilib``: torchneuron's bundled NKI library, laid out like AWS's NKI-lib.

The kernels torchneuron implements are importable under AWS's module paths and signatures
(``from nkilib.core.attention.attention_cte import attention_cte``, ...). torchneuron's own
kernel library, with its own names and layouts, is :mod:`torchneuron.nkilib`.

This package plays the role of the ``nkilib`` bundled with the Neuron compiler. As there, an
AWS nki-library that is installed (``pip install nki-library``: the ``nkilib_src`` package) or
on the Python path takes precedence: importing ``nkilib`` then gives AWS's package, its
submodules aliased under ``nkilib.*``. ``NKILIB_FORCE_BUNDLED_LIBRARY=1`` (or ``true``,
``yes``, ``on``) keeps this bundled one. See docs/nkilib.md.
"""

import importlib.util as _util
import os as _os
import sys as _sys

NKILIB_FORCE_BUNDLED_LIBRARY_ENV_VAR_KEY = "NKILIB_FORCE_BUNDLED_LIBRARY"
_HERE = _os.path.dirname(_os.path.realpath(__file__))


def _force_bundled() -> bool:
    val = _os.environ.get(NKILIB_FORCE_BUNDLED_LIBRARY_ENV_VAR_KEY, "").strip().lower()
    return val in ("1", "true", "yes", "on")


def _other_nkilib_on_path():
    """The spec of another ``nkilib`` package directory on sys.path (not this one), if any."""
    for entry in _sys.path:
        try:
            cand = _os.path.join(entry or _os.getcwd(), "nkilib", "__init__.py")
        except TypeError:
            continue
        if _os.path.isfile(cand) and _os.path.realpath(_os.path.dirname(cand)) != _HERE:
            return _util.spec_from_file_location(
                __name__, cand, submodule_search_locations=[_os.path.dirname(cand)])
    return None


def _alias_submodules(prefix: str) -> None:
    for key in list(_sys.modules):
        if key.startswith(prefix + "."):
            _sys.modules.setdefault(__name__ + key[len(prefix):], _sys.modules[key])


def _defer_to_aws() -> bool:
    """Replace this module by AWS's nki-library when one is installed or on the path."""
    if _force_bundled() or _sys.modules.get(__name__) is None:
        return False
    try:
        standalone = _util.find_spec("nkilib_src.nkilib") is not None
    except (ImportError, ValueError):
        standalone = False
    if standalone:
        import importlib
        try:
            impl = importlib.import_module("nkilib_src.nkilib")
        except Exception as e:  # a broken install must not silently fall back
            raise ImportError(f"nkilib_src (AWS nki-library) was found but failed to import: {e}. "
                              f"Fix its installation, uninstall it, or set "
                              f"{NKILIB_FORCE_BUNDLED_LIBRARY_ENV_VAR_KEY}=1 to use the "
                              "bundled nkilib") from e
        _sys.modules[__name__] = impl
        _alias_submodules("nkilib_src.nkilib")
        return True
    spec = _other_nkilib_on_path()
    if spec is not None:
        module = _util.module_from_spec(spec)
        _sys.modules[__name__] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            _sys.modules[__name__] = _self
            raise
        return True
    return False


_self = _sys.modules.get(__name__)
if not _defer_to_aws():
    from . import core  # noqa: F401  (bundled: torchneuron's kernels under AWS's paths)
    __all__ = ["core"]
