"""A stand-in for the Hugging Face hub on 127.0.0.1 (tests only): the two endpoints huggingface_hub uses to list a
repository (GET /api/models/<repo>) and fetch a file (HEAD/GET /<repo>/resolve/<revision>/<file>, with Range),
serving folders of this machine. `fail[file]` = "404" answers that file with 404; "drop" closes the connection
half-way through it once."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubMirror:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.fail: dict[str, str] = {}
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):  # noqa: N802 - http.server's names
                self._serve(head=True)

            def do_GET(self):  # noqa: N802
                self._serve(head=False)

            def _serve(self, head: bool):
                path = unquote(urlparse(self.path).path)
                mirror.requests.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:
                    return self._info("/".join(parts[2:4]))
                if len(parts) >= 5 and parts[2] == "resolve":
                    return self._file("/".join(parts[:2]), "/".join(parts[4:]), head)
                return self._send(404, b"not found", {})

            def _info(self, repo: str):
                folder = mirror.repos.get(repo)
                if folder is None:
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                siblings = [{"rfilename": str(f.relative_to(folder)), "size": f.stat().st_size}
                            for f in sorted(folder.rglob("*")) if f.is_file()]
                body = json.dumps({"id": repo, "modelId": repo, "sha": "a" * 40, "siblings": siblings}).encode()
                return self._send(200, body, {"Content-Type": "application/json"})

            def _file(self, repo: str, name: str, head: bool):
                folder = mirror.repos.get(repo)
                path = folder / name if folder is not None else None
                if path is None or not path.is_file() or mirror.fail.get(name) == "404":
                    return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
                data = path.read_bytes()
                headers = {"ETag": '"' + hashlib.sha256(data).hexdigest() + '"', "X-Repo-Commit": "a" * 40,
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                if head:
                    return self._send(200, b"", {**headers, "Content-Length": str(len(data))}, body_length=len(data))
                wanted = self.headers.get("Range") or ""
                start = int(wanted[6:].split("-")[0] or 0) if wanted.startswith("bytes=") else 0
                chunk = data[start:]
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                self.send_response(206 if start else 200)
                for key, value in {**headers, "Content-Length": str(len(chunk))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if mirror.fail.get(name) == "drop":
                    mirror.fail.pop(name)
                    self.wfile.write(chunk[: len(chunk) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.close()
                    return
                self.wfile.write(chunk)

            def _send(self, code: int, body: bytes, headers: dict, body_length: int | None = None):
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body) if body_length is None else body_length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range header of every GET of a file named `name` (None: from the start)."""
        return [rng for method, path, rng in self.requests if method == "GET" and path.endswith("/" + name)]
