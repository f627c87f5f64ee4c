"""The service's routes, one ``APIRouter`` per concern; each ``router(...)`` is built per app (its limits)."""

from collections.abc import Iterable, Iterator

from starlette.routing import BaseRoute


def flat_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, through included routers: recent FastAPI keeps an included router as one lazy
    entry of ``app.routes`` (its routes under ``original_router``), older versions copy them in."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from flat_routes(inner.routes)
        else:
            yield route
