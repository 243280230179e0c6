"""Which model a request names: a catalogued model by id or alias (``name:latest`` finds ``name``), or an instance
added beside the catalog; with exactly one model loaded, any other name (or none) reaches it."""

from __future__ import annotations

from tether.errors import ModelRequired, NotFound
from tether.fleet.scheduling.state import SchedulerState


class Names:
    """The names a request can use, over the catalog and the fleet (``default``: the model a placeholder name
    reaches when none is loaded, ``tether serve``'s first)."""

    def __init__(self, state: SchedulerState, default: str | None = None) -> None:
        self.catalog = state.catalog
        self.fleet = state.fleet
        self.slots = state.slots
        self.default = default

    def names(self) -> list[str]:
        """Every model a request can name: the catalog's, then instances added beside it."""
        return [*self.slots, *(h.id for h in self.fleet.list() if h.id not in self.slots)]

    def named(self, name: str) -> str | None:
        """The model id ``name`` names (catalogued id or alias, instance id; ``name:latest`` finds ``name``)."""
        model = self.catalog.find(name)
        if model is not None:
            return model.id
        hosted_ids = {h.id for h in self.fleet.list()}
        return next((c for c in (name, name.removesuffix(":latest")) if c in hosted_ids), None)

    def resolve(self, name: str | None) -> str:
        """The model id a request's ``model`` names: a catalogued model (by id or alias; ``name:latest`` finds
        ``name``) or an instance. With exactly one model loaded, any other name (or none) reaches it, as with
        llama.cpp's and llama-cpp-python's servers, whose clients often send a placeholder; with none loaded, the
        default model (``tether serve``'s first) does."""
        named = self.named(name) if name is not None else None
        if named is not None:
            return named
        hosted_ids = [h.id for h in self.fleet.list()]
        if len(hosted_ids) == 1:
            return hosted_ids[0]
        if not hosted_ids and self.default is not None:
            return self.default
        served = ", ".join(self.names()) or "none"
        if name is None and self.names():
            raise ModelRequired(f"'model' is required when more than one model is served; models: {served}")
        raise NotFound(f"model {name!r} is not served here; models: {served}")

    def resolve_exact(self, name: str) -> str:
        """The model id ``name`` names (id, alias, ``:latest``, instance id), without the placeholder rule."""
        named = self.named(name)
        if named is None:
            raise NotFound(f"model {name!r} is not served here; models: {', '.join(self.names()) or 'none'}")
        return named
