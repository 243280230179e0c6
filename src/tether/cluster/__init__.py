"""tether on a Ray cluster: one node agent per Ray node hosting runners as ``tether serve`` does, a coordinator that
places instances where they really fit, and heartbeats of tether's own that make losing a node a bounded,
explained event.

Which process each module runs in:

- ``wire``: both sides, the heartbeat path's messages and framing;
- ``agent``: a node agent (a Ray actor process on every node), node side;
- ``remote``: the coordinator (``tether serve --ray``), the stand-in for a supervisor whose runner is on a node;
- ``coordinator``: the coordinator, Ray itself, the agents, heartbeats, node loss and placement.

Only this package imports Ray, and only when ``tether serve --ray`` asks for it: single-node tether never does.
"""
