"""Fixtures of the binding's tests: the backends to test and a seeded generator per test.

Every test that takes ``gen`` gets a ``torch.Generator`` seeded with a fresh seed, printed in
the test's captured output (shown when it fails); set ``PAGEDATTN_SEED=<seed>`` to rerun with
that seed.
"""

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `import dense` from any working directory

import pagedattn  # noqa: E402

BACKENDS = ["reference", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]

_backends = {}


def get_backend(name: str) -> "pagedattn.Backend":
    """The backend ``name``, created once per session."""
    if name not in _backends:
        _backends[name] = pagedattn.Backend(name)
    return _backends[name]


@pytest.fixture(params=BACKENDS)
def backend(request) -> "pagedattn.Backend":
    """Each backend to test: ``reference``, ``cpu`` and, where torch sees a GPU, ``cuda``."""
    b = get_backend(request.param)
    assert b.name == request.param
    return b


@pytest.fixture(params=DTYPES, ids=DTYPE_IDS)
def dtype(request):
    """The activation dtypes: f32, f16, bf16."""
    return request.param


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or ``PAGEDATTN_SEED``), printed so that a failure can be rerun."""
    env = os.environ.get("PAGEDATTN_SEED")
    s = int(env) if env else random.SystemRandom().randrange(2**31)
    print(f"{request.node.nodeid}: PAGEDATTN_SEED={s}")
    return s


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g
