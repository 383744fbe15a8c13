"""Build the two assets TorchTitan's Llama 3 debug model reads, locally (nothing downloaded).

* ``<out>/tokenizer/``: a byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``
  with ``<|begin_of_text|>`` / ``<|end_of_text|>``), vocabulary 2,000 (the debug model has 2,048
  embedding rows), trained with the ``tokenizers`` library on the corpus below.
* ``<out>/c4_test/``: a JSON-lines dataset with a ``text`` column, the layout of TorchTitan's
  ``tests/assets/c4_test`` (``load_dataset(path, split="train")``).

The corpus is the docstrings of Python's standard library: English prose, present on every
machine, the same on every run for a given Python.

Usage: ``python prepare_assets.py OUT_DIR``
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import sys

_MODULES = ("argparse", "collections", "json", "logging", "pathlib", "subprocess", "threading",
            "unittest", "email", "http", "asyncio", "typing", "functools", "itertools", "re",
            "datetime", "decimal", "fractions", "statistics", "shutil", "tarfile", "zipfile")


def corpus() -> list[str]:
    """Docstrings of the modules above and their public members, in a fixed order."""
    texts: list[str] = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        mods = [mod]
        if hasattr(mod, "__path__"):
            for info in sorted(pkgutil.iter_modules(mod.__path__), key=lambda i: i.name):
                if info.name.startswith("_"):  # __main__ would run the package's CLI
                    continue
                try:
                    mods.append(importlib.import_module(f"{name}.{info.name}"))
                except Exception:  # optional submodules (e.g. Windows-only) are skipped
                    continue
        for m in mods:
            for _, obj in sorted(vars(m).items()):
                doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
                if doc and len(doc) > 200:
                    texts.append(" ".join(doc.split()))
    return sorted(set(texts))


def build(out: str, vocab_size: int = 2000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = corpus()
    os.makedirs(os.path.join(out, "tokenizer"), exist_ok=True)
    os.makedirs(os.path.join(out, "c4_test"), exist_ok=True)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(os.path.join(out, "tokenizer", "tokenizer.json"))
    with open(os.path.join(out, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": True,
                   "add_eos_token": True}, f)
    with open(os.path.join(out, "c4_test", "data.json"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python prepare_assets.py OUT_DIR")
    build(sys.argv[1])
    print(f"tokenizer and dataset written to {sys.argv[1]}")
