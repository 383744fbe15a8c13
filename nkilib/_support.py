"""Helpers of the bundled nkilib's AWS-signature entry points."""

from __future__ import annotations


def unsupported(kernel: str, what: str, instead: str) -> None:
    """Raise NotImplementedError for an AWS option the bundled kernel does not implement."""
    raise NotImplementedError(f"{kernel}: {what} is not implemented by torchneuron's bundled "
                              f"nkilib; {instead}")
