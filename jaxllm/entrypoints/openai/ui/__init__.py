"""The chat page (`GET /` and `/ui`): one static HTML page, its script and its style sheet, shipped in the
package and served from memory. No build step and nothing fetched from elsewhere: the page works offline.

The page talks to the server's own `/v1` API from the browser (streamed chat completions), so the API key
middleware guards its calls and not the page; everything it keeps (conversations, settings, the key) stays
in the browser's local storage.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# name → media type; the page is served at / and /ui, its assets under /ui/
ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    # defence in depth behind the page's own escaping: only this server's scripts, styles and API
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def read_asset(name: str) -> bytes:
    """One of the page's files, as shipped in the package."""
    return resources.files(__name__).joinpath(name).read_bytes()


def add_ui_routes(app: FastAPI) -> None:
    """GET / and /ui (the page) and /ui/<asset>; files are read once, now."""
    page = read_asset("index.html")

    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    for path in ("/", "/ui"):
        app.add_api_route(path, index, methods=["GET"], include_in_schema=False)
    for name, media_type in ASSETS.items():
        app.add_api_route(
            f"/ui/{name}", asset_route(read_asset(name), media_type), methods=["GET"], include_in_schema=False
        )


def asset_route(body: bytes, media_type: str):
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return asset
