"""parallelisms.torch_compat: the one place that reads torch's version."""

from __future__ import annotations

import pytest
import torch

from parallelisms.torch_compat import MIN_TORCH, torch_at_least, torch_version


@pytest.mark.parametrize("version, expected", [("2.13.0+cpu", (2, 13)), ("2.11.0+cu130", (2, 11)),
                                               ("2.12.0a0+git1a2b3c", (2, 12)), ("3.0.1", (3, 0))])
def test_version_is_read_from_torch(monkeypatch, version, expected):
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_version() == expected
    assert torch_at_least(*expected) and not torch_at_least(expected[0], expected[1] + 1)
    assert torch_at_least(2, 11) is (expected >= (2, 11))


def test_this_torch_is_supported():
    assert torch_at_least(*MIN_TORCH)


def test_unreadable_version_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "nightly")
    with pytest.raises(RuntimeError, match="cannot read torch's version from 'nightly'"):
        torch_version()
