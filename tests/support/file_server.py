"""A threaded HTTP server on 127.0.0.1 serving adapter archives to the guard's fetch in unit tests:
fixed bodies, bodies generated as they are sent (no Content-Length), and redirects."""
from __future__ import annotations

import http.server
import threading
from typing import Callable, Iterator

Route = Callable[[http.server.BaseHTTPRequestHandler], None]


class FileServer:
    """A threaded HTTP server on 127.0.0.1; ``routes`` maps a path (query included) to a handler."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.sent = 0
        routes = self.routes

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path) or routes.get(self.path.split("?", 1)[0])
                if route is None:
                    self.send_error(404)
                    return
                try:
                    route(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def body(self, path: str, data: bytes, status: int = 200) -> str:
        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(status)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        self.routes[path] = route
        return self.url + path

    def stream(self, path: str, chunks: Callable[[], Iterator[bytes]]) -> str:
        """An answer without a Content-Length, written chunk by chunk as it is generated."""
        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Connection", "close")
            h.end_headers()
            for chunk in chunks():
                h.wfile.write(chunk)
                self.sent += len(chunk)
        self.routes[path] = route
        return self.url + path

    def redirect(self, path: str, location: str) -> str:
        def route(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(302)
            h.send_header("Location", location)
            h.send_header("Content-Length", "0")
            h.end_headers()
        self.routes[path] = route
        return self.url + path

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
