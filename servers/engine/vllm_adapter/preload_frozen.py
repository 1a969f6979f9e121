"""Imported last by the engine core's forkserver (``core_preload.ENGINE_CORE_MODULES``): every
object its imports made is moved out of the garbage collector's sight (``gc.freeze``) before
the engine core is forked from it.

The engine core shares those pages with the forkserver until either writes to them, and a
collection writes to every object it examines (its bookkeeping lives in each object's header):
the engine core's first collections would copy most of them, and the forkserver, which stays
up beside it, would keep the originals as memory of its own. Frozen, the collector never
examines them in either process (what CPython's documentation advises before a fork).
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
