"""`one_thread`: import it into a test module that runs tiny models (an autouse fixture there)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core machine they spin-wait badly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
