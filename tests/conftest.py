"""Fixtures shared by the whole suite.

Factories of clusters, models and plans live in `factories` (tests/ is on pythonpath;
import them by name: a conftest cannot be imported). The fixtures here hand out the
built-in model and cluster most tests run on, loaded afresh for each test.
"""

from __future__ import annotations

import pytest

from hyperpipe.cluster.cluster import Cluster, load_cluster
from hyperpipe.models import load_model
from hyperpipe.models.spec import ModelSpec


@pytest.fixture
def tiny_gpt() -> ModelSpec:
    """The built-in `tiny-gpt` (8 cut units; trains on a CPU in seconds)."""
    return load_model("tiny-gpt")


@pytest.fixture
def demo_hetero() -> Cluster:
    """The built-in `demo-hetero` cluster: a100/0-1 and v100/0-1 on two nodes."""
    return load_cluster("demo-hetero")
