"""``import nkilib``: torchneuron's bundled package unless an AWS nki-library is installed
(``nkilib_src``) or on the path; ``NKILIB_FORCE_BUNDLED_LIBRARY`` keeps the bundled one.

Each case runs in a fresh interpreter (imports are process-wide) with a fake AWS package in a
temporary directory."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = textwrap.dedent("""
    import os, sys
    import nkilib
    mark = getattr(nkilib, "MARK", None)
    if mark is None:  # bundled: importing its kernels would import torch (slow): report its path
        mark = "bundled" if os.path.dirname(nkilib.__file__) == os.path.join(sys.argv[1], "nkilib") else "?"
        mod = "-"
    else:
        from nkilib.core.attention.attention_cte import attention_cte
        mod = attention_cte.__module__
    print(nkilib.__name__, mark, mod)
""")


def _write(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def fake_aws_tree(root, package_root, mark):
    """An nkilib package (AWS layout) under ``package_root`` with a marker attribute."""
    base = os.path.join(root, package_root)
    _write(os.path.join(base, "__init__.py"), f"MARK = {mark!r}\n")
    _write(os.path.join(base, "core", "__init__.py"))
    _write(os.path.join(base, "core", "attention", "__init__.py"))
    _write(os.path.join(base, "core", "attention", "attention_cte.py"),
           "def attention_cte(*a, **k):\n    return 'aws'\n")


def probe(pythonpath, env=None, cwd=ROOT):
    e = dict(os.environ)
    e.pop("NKILIB_FORCE_BUNDLED_LIBRARY", None)
    e["PYTHONPATH"] = os.pathsep.join(pythonpath)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", PROBE, ROOT], cwd=cwd, env=e, capture_output=True,
                       text=True, timeout=120)
    return r


def test_an_installed_aws_nki_library_takes_precedence(tmp_path):
    _write(str(tmp_path / "nkilib_src" / "__init__.py"))
    fake_aws_tree(str(tmp_path), os.path.join("nkilib_src", "nkilib"), "aws-installed")
    r = probe([str(tmp_path)])
    assert r.returncode == 0, r.stderr
    name, mark, mod = r.stdout.split()
    assert (name, mark) == ("nkilib_src.nkilib", "aws-installed")
    assert mod == "nkilib.core.attention.attention_cte"  # AWS's module, reached as nkilib.*


@pytest.mark.parametrize("value", ["1", "ON"])
def test_force_bundled_keeps_torchneurons_nkilib(tmp_path, value):
    _write(str(tmp_path / "nkilib_src" / "__init__.py"))
    fake_aws_tree(str(tmp_path), os.path.join("nkilib_src", "nkilib"), "aws-installed")
    r = probe([str(tmp_path)], {"NKILIB_FORCE_BUNDLED_LIBRARY": value})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["nkilib", "bundled", "-"]


def test_an_aws_nkilib_directory_on_the_path_takes_precedence(tmp_path):
    # cwd is the torchneuron checkout, so Python finds our nkilib first; it defers
    fake_aws_tree(str(tmp_path), "nkilib", "aws-on-path")
    r = probe([str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["nkilib", "aws-on-path"]


def test_without_an_aws_library_nkilib_is_the_bundled_one(tmp_path):
    r = probe([str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["nkilib", "bundled", "-"]


def test_a_broken_aws_install_fails_loudly_instead_of_falling_back(tmp_path):
    _write(str(tmp_path / "nkilib_src" / "__init__.py"))
    _write(str(tmp_path / "nkilib_src" / "nkilib" / "__init__.py"), "import no_such_dependency\n")
    r = probe([str(tmp_path)])
    assert r.returncode != 0
    assert "nkilib_src (AWS nki-library) was found but failed to import" in r.stderr
    assert "NKILIB_FORCE_BUNDLED_LIBRARY" in r.stderr
