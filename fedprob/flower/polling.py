"""Waiting for Flower messages without Flower 1.41's fixed 3 s sleeps.

Flower 1.41 waits a fixed 3 s on both sides of a round: the ServerApp's
``Grid.send_and_receive`` sleeps 3 s between pulls of the replies, and a
SuperNode sleeps 3 s after every pull that found no message. A round then
costs up to 6 s of waiting on top of its work (about 3 s on average).

* :class:`PromptGrid` wraps the ServerApp's grid: ``send_and_receive`` pushes
  the messages and pulls the replies with Flower's public ``push_messages`` /
  ``pull_messages``, waiting ``first_wait_s`` after the first empty pull and
  growing the wait by ``growth`` up to ``max_wait_s`` (defaults 0.05 s, 1.5,
  0.5 s), so a reply is seen within half a second of its arrival. A grid
  without ``push_messages`` / ``pull_messages`` keeps its own
  ``send_and_receive``.
* :func:`main` runs Flower's own ``flower-supernode`` command in this process
  with its idle wait shortened to ``FEDPROB_SUPERNODE_POLL_S`` seconds
  (default 0.2): ``fedprob flower supernode`` starts its SuperNode this way.
  If the installed Flower has no such wait where 1.41 has it, the SuperNode
  runs unchanged and says so.
"""
from __future__ import annotations

import os
import sys
import time


class PromptGrid:
    """A Flower grid whose ``send_and_receive`` polls promptly (module docstring); every other
    attribute is the wrapped grid's."""

    def __init__(self, grid, first_wait_s: float = 0.05, growth: float = 1.5, max_wait_s: float = 0.5):
        if not 0 < first_wait_s <= max_wait_s or growth < 1:
            raise ValueError("need 0 < first_wait_s <= max_wait_s and growth >= 1")
        self._grid = grid
        self.first_wait_s, self.growth, self.max_wait_s = first_wait_s, growth, max_wait_s

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        """Push ``messages`` and return the replies that arrive within ``timeout`` seconds
        (None: wait for all of them), as Flower's ``Grid.send_and_receive``."""
        if not (hasattr(self._grid, "push_messages") and hasattr(self._grid, "pull_messages")):
            return self._grid.send_and_receive(messages, timeout=timeout)     # a grid of its own kind
        pending = set(self._grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + float(timeout)
        wait, replies = self.first_wait_s, []
        while pending:
            got = list(self._grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending:
                break
            now = time.monotonic()
            if end is not None and now >= end:
                break
            time.sleep(wait if end is None else min(wait, end - now))
            wait = min(wait * self.growth, self.max_wait_s)
        return replies


class _ShortSleeps:
    """``time`` as Flower's SuperNode loop sees it: sleeps capped at ``cap`` seconds."""

    def __init__(self, cap: float):
        self.cap = cap

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds):
        time.sleep(min(seconds, self.cap))


def shorten_supernode_wait(cap: float) -> bool:
    """Cap the sleeps of Flower's SuperNode loop at ``cap`` seconds; False if this Flower has no
    such loop (then nothing changes)."""
    try:
        from flwr.supernode import start_client_internal as loop
    except ImportError:
        return False
    if getattr(loop, "time", None) is not time:
        return False
    loop.time = _ShortSleeps(cap)
    return True


def main(argv=None) -> None:
    """``python -m fedprob.flower.polling ARGS``: Flower's ``flower-supernode ARGS``, waiting at
    most ``FEDPROB_SUPERNODE_POLL_S`` seconds (default 0.2) between pulls."""
    cap = float(os.environ.get("FEDPROB_SUPERNODE_POLL_S", "0.2"))
    if not cap > 0:
        raise ValueError(f"FEDPROB_SUPERNODE_POLL_S must be positive, got {cap}")
    if not shorten_supernode_wait(cap):
        print("fedprob: this Flower's SuperNode loop is not the one fedprob knows; its own "
              "polling interval is kept", file=sys.stderr)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode"] + list(sys.argv[1:] if argv is None else argv)
    flower_supernode()


if __name__ == "__main__":
    main()
