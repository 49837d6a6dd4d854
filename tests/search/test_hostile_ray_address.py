"""Hostile input (issue 33, case 7): a malformed `--ray-address` is one line and exit 2
before Ray is imported or started (Ray answers it with a traceback)."""

from __future__ import annotations

import pytest
from hostile import (
    assert_one_line,
    clean_case,  # noqa: F401 (autouse: no temp file, no process)
    cli,
)

from hyperpipe.core.errors import BadInput
from hyperpipe.search import backends

BAD = ["not a host:xx", "host", "host:0", "host:65536", ":6379", "host:6\u00b2",
       "ray://", "a b:1", "host:1\n"]


@pytest.mark.parametrize("address", BAD)
def test_malformed_ray_address_is_refused_first(address, capsys, monkeypatch):
    monkeypatch.setattr(backends, "import_ray", lambda: pytest.fail("Ray was imported"))
    rc, out, err = cli(capsys, ["search", "--cluster", "demo-hetero", "--model", "tiny-gpt",
                                "--global-batch", "8", "--backend", "ray",
                                "--ray-address", address])
    assert_one_line(rc, err, 2, "--ray-address")
    assert out == ""


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:6379", "head.example:6379",
                                     "ray://head:10001", "[::1]:6379"])
def test_well_formed_ray_address_passes(address):
    backends.check_ray_address(address)
    with pytest.raises(BadInput):
        backends.check_ray_address(address + " x")
