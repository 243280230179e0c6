"""The scheduler in parts, one job each (``tether.fleet.scheduler`` assembles them behind one ``Scheduler``):

- ``settings``: its knobs in one value; ``decisions``: the one decision log; ``slots``: a catalogued model's state
  and what its runner holds; ``state``: what every part shares;
- ``names``: which model a request names; ``leases``: a request's hold on its model, waiting for its load;
- ``loading``: loads, one per model however many ask; ``keepalive``: unloading idle models; ``unloading``: stopping
  a runner and waiting for its group to be gone;
- ``placement``: the node's one placement at a time, making room; ``eviction``: which idle models go, by host and
  GPU memory or by count; ``reclaim``: evicting them and waiting for their memory to come back.
"""
