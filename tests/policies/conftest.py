"""Fixtures of the policy tests; the doubles themselves live in policy_doubles.py."""

import pytest
from policy_doubles import make_ctx


@pytest.fixture
def ctx_factory():
    return make_ctx
