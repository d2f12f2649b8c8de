"""The Hugging Face Hub's HTTP API as huggingface_hub calls it (tree listing, revision info,
resolve HEAD/GET), serving files from memory and counting the file bytes it sends. The weights
download (``gpufleet-engine fetch-model``) runs against it, in a test process or in a real pod."""
from __future__ import annotations

import hashlib
from pathlib import Path

from aiohttp import web


class FakeHub:
    SHA = "c" * 40

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.sent_bytes = 0
        self.requested: list[str] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    @classmethod
    def from_folder(cls, folder: Path) -> "FakeHub":
        return cls({str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
                    if p.is_file() and not p.name.startswith(".")})

    def app(self) -> web.Application:
        async def handle(request: web.Request) -> web.StreamResponse:
            path = request.path
            self.requested.append(path)
            if "/tree/" in path:
                return web.json_response([{"type": "file", "path": f, "size": len(b),
                                           "oid": hashlib.sha1(b).hexdigest()} for f, b in self.files.items()])
            if "/revision/" in path:
                return web.json_response({"id": "org/m", "sha": self.SHA,
                                          "siblings": [{"rfilename": f} for f in self.files]})
            if "/resolve/" in path:
                body = self.files.get(path.split("/resolve/", 1)[1].split("/", 1)[1])
                if body is None:
                    return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
                headers = {"X-Repo-Commit": self.SHA, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                           "Content-Length": str(len(body))}
                if request.method == "HEAD":
                    return web.Response(headers=headers)
                self.sent_bytes += len(body)
                return web.Response(body=body, headers=headers)
            return web.Response(status=404)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    async def start(self, host: str = "127.0.0.1") -> str:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        await web.TCPSite(self._runner, host, 0).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
