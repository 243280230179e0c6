"""The fault campaign (``tether chaos``): randomized attacks on a ``tether serve`` it starts itself, and the
promises checked from outside after every trial.

Runs in its own process, never inside a worker: it drives the servers it starts only through public interfaces
(HTTP with a real client, signals, ``/proc``), so what it proves holds for any client. ``plan`` draws the trials
from a seed (each replays alone: ``tether chaos --seed S --only K``), ``target`` is the server under attack,
``trial`` runs one attack and checks the invariants, ``campaign`` runs many and reports. May import only the
shared modules (the wire's cause kinds, ``tether.kernel``), never the worker's code it is testing.
"""
