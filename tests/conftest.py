"""Fixtures shared by the test modules (pytest loads this file for every test under tests/)."""

from __future__ import annotations

import pytest
import torch

from txl import TransformerXLConfig

TINY = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=8, dropout=0.0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine every parallel region of
    the many small ops waits for a descheduled thread (measured: minutes instead of seconds). Use it
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    """`tiny(**overrides)`: a small TransformerXLConfig (2 layers, d_model 32, 4 heads, no dropout)."""

    def make(**overrides) -> TransformerXLConfig:
        return TransformerXLConfig(**{**TINY, **overrides})

    return make
