"""Linux primitives both process sides use: pidfds and /proc/PID/stat (``pids``), memory cgroups (``cgroups``).

Imports nothing of tether's but ``tether.units``: a runner uses these before anything else is set up.
"""
