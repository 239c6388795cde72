"""Imported last by the fork server of `gloo_ranks` (its preload, as
``benchmarks.forkserver_heap``: the server's path is the directory it starts in, the
repository's root), never by a rank or a caller: freezes the server's heap, so that the
ranks forked from it leave it out of every collection.

A rank that measures its step's memory over all of its process (`PeakTracker` with
``follow_resizes``) collects the garbage before each step and lists every object alive:
0.2-0.3 s a step over the ~330,000 objects that importing torch and the planner makes, about
3 % of the suite's time. The preload makes no tensor (``tests/test_gloo_ranks.py``), so a
frozen object is never one the measure should see. Python's documented practice for
processes forked without exec (``gc.freeze``).
"""

import gc

gc.freeze()
