"""The worker side on one machine: starting runners and keeping every promise about them.

Runs in the worker process (``tether run``, ``tether serve``, or your program). One module per promise:
``spawn`` (start a runner: its pipes, lifeline and exit), ``life`` (the contract every runner life keeps, and the
task group each owns), ``supervisor`` (one local runner's life: lifecycle and task table) with ``stacks`` (native
and Python stacks of a hung runner) and ``containment`` (its cgroup and memory samples), ``ranks`` (a life of N
ranks that fail and restart as one), ``diagnosis`` (a death's cause), ``hangs`` (deadlines), ``oom``
(out-of-memory evidence), ``memory`` and ``nvml`` (memory as it really is), ``fit`` (does a model fit before it
loads), ``instance`` (a model instance and its restart policy), ``gone`` (a life confirmed gone), ``registry`` and
``orphans`` (runners that outlived a dead worker), ``output`` (runner logs), ``drill`` (the orphan drill tests and
benchmarks run). May import the wire, ``tether.kernel``, ``tether.engines`` and ``tether.runner``'s constants;
never ``tether.fleet``, ``tether.serve``, ``tether.cluster`` or ``tether.cli``.
"""
