"""Prompt polling on Flower's Deployment Engine: replies seen within half a second, the
SuperNode's idle wait shortened (fedprob.flower.polling)."""
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from fedprob.flower import polling  # noqa: E402


class SlowRepliesGrid:
    """Replies to message i arrive ``delays[i]`` seconds after the push; counts the pulls."""

    def __init__(self, delays):
        self.delays, self.pulls, self.t0 = delays, 0, None
        self.other = "kept"

    def push_messages(self, messages):
        self.t0 = time.monotonic()
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        now = time.monotonic() - self.t0
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i))
                for i in sorted(ids) if now >= self.delays[int(i[1:])]]


def test_prompt_grid_sees_replies_within_its_longest_wait():
    inner = SlowRepliesGrid([0.0, 0.3, 0.6])
    grid = polling.PromptGrid(inner)
    t = time.monotonic()
    replies = grid.send_and_receive(["a", "b", "c"], timeout=10)
    took = time.monotonic() - t
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert 0.6 <= took < 0.6 + grid.max_wait_s + 0.2       # Flower's own loop: 3 s
    assert inner.pulls >= 3
    assert grid.other == "kept"                             # everything else is the wrapped grid's


def test_prompt_grid_returns_what_came_at_the_timeout():
    grid = polling.PromptGrid(SlowRepliesGrid([0.0, 30.0]))
    t = time.monotonic()
    replies = grid.send_and_receive(["a", "b"], timeout=0.4)
    assert 0.4 <= time.monotonic() - t < 0.8
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]


def test_prompt_grid_checks_its_waits():
    with pytest.raises(ValueError, match="first_wait_s"):
        polling.PromptGrid(object(), first_wait_s=1.0, max_wait_s=0.5)


def test_supernode_wait_is_shortened_in_flowers_own_loop(monkeypatch):
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(loop, "time", time)
    assert polling.shorten_supernode_wait(0.01)
    t = time.monotonic()
    loop.time.sleep(3)                                      # the loop's fixed idle wait
    assert time.monotonic() - t < 0.5
    assert loop.time.monotonic() > 0                        # the rest of ``time`` unchanged
    assert not polling.shorten_supernode_wait(0.01)         # already patched: left as it is
