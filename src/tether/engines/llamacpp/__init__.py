"""The llama.cpp engine: one package, so ``engines/`` shows the contract apart from the one engine that implements it.

Only the registry names it (``tether.engines.llamacpp.engine:LlamaCppEngine``); everything else reaches it through
the contract in ``tether.engines.base``. Importing this package loads nothing of llama-cpp-python.
"""
