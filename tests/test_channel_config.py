"""Channel settings are checked at creation: a negative or non-integer
``maxsize`` (every put would block) and a re-created channel that would silently keep its old
``maxsize`` are clear errors."""

from __future__ import annotations

import pytest

from m2flow import Channel

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_maxsize_is_refused(cluster, bad):
    with pytest.raises(ValueError, match="maxsize"):
        Channel.create("cfg_bad", maxsize=bad)


def test_recreating_a_channel_with_another_maxsize_is_refused(cluster):
    ch = Channel.create("cfg_re", maxsize=2)
    try:
        assert Channel.create("cfg_re", maxsize=2).name == "cfg_re"  # same settings: connect
        with pytest.raises(ValueError, match="already exists with maxsize=2, not 5"):
            Channel.create("cfg_re", maxsize=5)
        ch.put(1)
        ch.put(2)
        with pytest.raises(TimeoutError, match="stayed full"):  # still bounded at 2
            ch.put(3, timeout=1)
    finally:
        ch.close()
