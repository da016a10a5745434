"""Engines that move a round's messages: :class:`Local` (vmap, or ``shard_map`` over devices and
processes; :mod:`.local`, :mod:`.sharded`) and :class:`Flower` (a Flower simulation; :mod:`.flower`).

Pass one to ``fp.run(..., engine=fp.engine.Local(client_chunk=4))``.
"""
from .flower_plan import Flower
from .local_plan import Local

__all__ = ["Local", "Flower"]
