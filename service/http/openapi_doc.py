"""The OpenAPI document as served: built within the served models' limits once they load, at /openapi.json, with
Swagger UI and ReDoc over it. No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import Response

from contract.decoder_metadata import DecoderMetadata
from service.dataplane import DataPlane
from service.responses import json_response
from service.validation import Bounds

Build = Callable[[list[str], list[str], Bounds], dict[str, Any]]  # models, routes, bounds -> the document


def add_routes(app: FastAPI, plane: DataPlane, build: Build) -> None:
    """The OpenAPI document, Swagger UI and ReDoc, where FastAPI serves them."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> Response:
        return json_response(await served_document(app, plane, build))

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


async def served_document(app: FastAPI, plane: DataPlane, build: Build) -> dict[str, Any]:
    """The document within the served models' limits; kept once every model has loaded (metadata never changes;
    a change of routes clears it), built afresh until then from those that have."""
    if app.openapi_schema is None:
        statuses = [await plane.model_status(name) for name in plane.models.names]
        metas = [s.metadata for s in statuses if s.ready and s.metadata is not None]
        loaded = [m for m in metas if not isinstance(m, DecoderMetadata)]  # the classifiers' bodies are bounded
        built = build(plane.models.names, plane.models.routes.names, Bounds.of(plane.limits.max_rows, loaded))
        if len(metas) < len(statuses):
            return built
        app.openapi_schema = built
    return app.openapi_schema
