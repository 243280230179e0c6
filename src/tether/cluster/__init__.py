"""tether on a Ray cluster: one node agent per Ray node hosting runners as ``tether serve`` does, a coordinator that
places instances where they really fit, and heartbeats of tether's own that make losing a node a bounded,
explained event.

Which process each module runs in:

- ``wire``: both sides, the heartbeat path's messages and framing;
- ``agent``: a node agent (a Ray actor process on every node), node side;
- ``link``: the coordinator, its view of one agent, shared by the coordinator and the lives hosted there;
- ``remote``: the coordinator (``tether serve --ray``), the runner life (``tether.node.life``) whose runner is on a
  node;
- ``placement``: the coordinator, the pure rule placing a split model's ranks by each node's free memory;
- ``coordinator``: the coordinator, Ray itself, the agents, heartbeats, node loss and placement.

Only this package imports Ray, and only when ``tether serve --ray`` asks for it: single-node tether never does.
May import the wire, ``tether.kernel``, ``tether.engines``' registry, ``tether.runner``'s constants and
``tether.node``; never ``tether.fleet`` (which knows a cluster only through its ``Runners`` protocol),
``tether.serve`` or ``tether.cli``.
"""
