"""The ecosystem tests run the libraries users already run (extra ``ecosystem`` in pyproject)
on neuron, each compared with the same library on CPU. Nothing is downloaded: models are built
from configs with random weights, tokenizers trained locally (``tokenizers`` library)."""

import os

# Before any Hugging Face import: no hub access, ever.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer trained here on a fixed sentence list (PreTrainedTokenizerFast)."""
    from hf_support import train_word_tokenizer

    return train_word_tokenizer()


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's singletons reset before and after the test (they remember the device)."""
    from hf_support import reset_accelerate_state

    reset_accelerate_state()
    yield
    reset_accelerate_state()
