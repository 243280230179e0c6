"""The node's serving logic, without HTTP: which instances run, which models can be asked for, and who gets a slot.

Runs in the worker process (``tether serve``, or your program). ``fleet`` owns the instances (each a
``tether.node.instance.Instance`` with its replicas) and admits requests to their queues; ``catalog`` is the models
a request may name (a ``--catalog`` file, a ``--models`` directory, the built-in default) and how long each stays
loaded; ``scheduler`` loads, unloads and evicts them by true memory; ``facts`` reads what a model file says about
itself (its GGUF header). May import the wire, ``tether.kernel``, ``tether.engines``' registry and ``tether.node``;
never ``tether.serve`` (HTTP is the front's), ``tether.cluster`` (known through a protocol) or ``tether.cli``.
"""
