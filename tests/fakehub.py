"""A local stand-in for the Hugging Face hub's file endpoints and a PyPI simple index, on 127.0.0.1.

Hub: HEAD/GET /{owner}/{repo}/resolve/{revision}/{file} with X-Repo-Commit, ETag (sha256), Content-Length and
Range support; GET /api/models/{owner}/{repo}/tree/{revision}?recursive=...
(huggingface_hub's HfApi.list_repo_tree / list_repo_files) lists a repo's files. Index: /simple/{name}/ and /files/{wheel} (PEP 503), for the pypi-chunks mirrors."""

from __future__ import annotations

import hashlib
import io
import re
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "a" * 40


def make_wheel(name: str, version: str, member: str, data: bytes) -> tuple[str, bytes]:
    dist = name.replace("-", "_")
    fname = f"{dist}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return fname, buf.getvalue()


class FakeHub:
    def __init__(self) -> None:
        self.files: dict[tuple[str, str], bytes] = {}  # (repo, path) -> bytes
        self.wheels: dict[str, tuple[str, bytes]] = {}  # normalized name -> (filename, bytes)
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, range)
        self.fail_hub = False
        self.slow = False  # stream bodies in small, delayed pieces
        self.drop_next_get = False
        self.missing_packages: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _file(self):
                m = re.match(r"^/(?:models/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
                return (m.group(1), m.group(3)) if m else None

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _tree(self, head):
                import json

                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/?]+)", self.path)
                repo = m and m.group(1)
                if hub.fail_hub:
                    return self._send(500, b"error", head=head)
                if not m or not any(r == repo for r, _ in hub.files):
                    return self._send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
                entries = [{"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                            "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                           for (r, p), d in sorted(hub.files.items()) if r == repo]
                body = json.dumps(entries).encode()
                return self._send(200, body, {"Content-Type": "application/json"}, head)

            def _serve(self, head):
                rng = self.headers.get("Range")
                hub.log.append(("HEAD" if head else "GET", self.path, rng))
                if self.path.startswith("/simple/"):
                    name = self.path.split("/")[2]
                    if name not in hub.wheels or name in hub.missing_packages:
                        return self._send(404, b"not found", head=head)
                    fname, data = hub.wheels[name]
                    sha = hashlib.sha256(data).hexdigest()
                    body = f'<html><body><a href="/files/{fname}#sha256={sha}">{fname}</a></body></html>'.encode()
                    return self._send(200, body, {"Content-Type": "text/html"}, head)
                if self.path.startswith("/files/"):
                    fname = self.path.split("/")[2]
                    for f, data in hub.wheels.values():
                        if f == fname:
                            return self._send(200, data, {"Content-Type": "application/octet-stream"}, head)
                    return self._send(404, b"", head=head)
                if self.path.startswith("/api/models/"):
                    return self._tree(head)
                key = self._file()
                if key is None or hub.fail_hub:
                    return self._send(500 if hub.fail_hub else 404, b"error", head=head)
                if key not in hub.files:
                    return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"}, head)
                data = hub.files[key]
                sha = hashlib.sha256(data).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if head:
                    headers["Content-Length"] = str(len(data))
                    return self._send(200, b"", headers, head=True)
                start, end = 0, len(data) - 1
                code = 200
                if rng:
                    m = re.match(r"bytes=(\d+)-(\d*)", rng)
                    start = int(m.group(1))
                    end = min(int(m.group(2)), len(data) - 1) if m.group(2) else len(data) - 1
                    code = 206
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                body = data[start : end + 1]
                headers["Content-Length"] = str(len(body))
                if hub.drop_next_get and not rng and len(body) > 1000:
                    hub.drop_next_get = False
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if hub.slow:
                    import time

                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    try:
                        for i in range(0, len(body), 4096):
                            self.wfile.write(body[i : i + 4096])
                            self.wfile.flush()
                            time.sleep(0.05)
                    except OSError:
                        pass
                    return
                self._send(code, body, headers)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add_file(self, repo: str, path: str, data: bytes) -> str:
        self.files[(repo, path)] = data
        return hashlib.sha256(data).hexdigest()

    def add_chunks(self, prefix: str, version: str, data: bytes, parts: int) -> None:
        n = -(-len(data) // parts)
        for i in range(parts):
            name = f"{prefix}{i + 1}"
            self.wheels[name] = make_wheel(name, version, f"{name.replace('-', '_')}/data/part{i + 1:02d}.bin", data[i * n : (i + 1) * n])
