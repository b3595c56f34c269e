"""A Hugging Face Hub on 127.0.0.1 for tests: the routes huggingface_hub's
`snapshot_download` uses (repository info at a revision, the file tree, each file's
`resolve` URL), served from repositories held in memory, with the Hub's error headers for
a gated repository, a missing repository and a missing revision. Every request is
recorded, so a test can count downloads. And `lay_out_cache`: a cache folder as
huggingface_hub writes it (blobs, snapshots of symlinks, refs), without a server."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    """One repository: `refs` (branch or tag -> commit) and each commit's files."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False  # refuses every request without a token, as the Hub does

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def oid(data: bytes) -> str:
    """A file's git blob id, as the Hub reports it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit_id(files: dict[str, bytes]) -> str:
    return hashlib.sha1(json.dumps({k: oid(v) for k, v in sorted(files.items())}).encode()
                        ).hexdigest()


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def lay_out_cache(cache: Path, kind: str, repo_id: str, repo: Repo) -> None:
    """`repo` as huggingface_hub's cache holds it after a download: content-addressed
    blobs, one snapshot folder of relative symlinks per commit, one ref file per name."""
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    for commit, files in repo.commits.items():
        for name, data in files.items():
            blob = root / "blobs" / oid(data)
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = root / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in repo.refs.items():
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)


class HubServer:
    """`with HubServer(repos) as hub:` serves `repos` ({(kind, "org/name"): Repo}) at
    `hub.url` (set HF_ENDPOINT to it); `hub.requests` lists (method, path) of each."""

    def __init__(self, repos: dict[tuple[str, str], Repo]):
        self.repos, self.requests = repos, []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self, body=True)

            def do_HEAD(self) -> None:
                server._answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def downloads(self, name: str) -> int:
        """GET requests of a file named `name` (by its resolve URL)."""
        return sum(1 for m, p in self.requests if m == "GET" and "/resolve/" in p
                   and p.endswith("/" + name))

    _API = re.compile(r"/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?")
    _FILE = re.compile(r"(/datasets)?/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        with self._lock:
            self.requests.append((handler.command, path))
        api, file = self._API.fullmatch(path), self._FILE.fullmatch(path)
        if api:
            kind, repo_id, route, revision = api.group(1)[:-1], api.group(2), api.group(3), api.group(4)
        elif file:
            kind = "dataset" if file.group(1) else "model"
            repo_id, revision, name = file.group(2), file.group(3), file.group(4)
        else:
            return self._send(handler, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        repo = self.repos.get((kind, repo_id))
        if repo is None:
            return self._send(handler, 401, b"", {"X-Error-Code": "RepoNotFound",
                                                  "X-Error-Message": "Repository not found"}, body)
        if repo.gated and "authorization" not in {k.lower() for k in handler.headers}:
            return self._send(handler, 403, b"", {"X-Error-Code": "GatedRepo",
                                                  "X-Error-Message": "Access restricted"}, body)
        commit = repo.commit(revision)
        if commit is None:
            return self._send(handler, 404, b"", {"X-Error-Code": "RevisionNotFound",
                                                  "X-Error-Message": "Invalid rev id"}, body)
        files = repo.commits[commit]
        if api and route == "revision":
            info = {"id": repo_id, "sha": commit, "private": False,
                    "siblings": [{"rfilename": n} for n in files]}
            return self._send(handler, 200, json.dumps(info).encode(),
                              {"Content-Type": "application/json"}, body)
        if api:
            tree = [{"type": "file", "oid": oid(d), "size": len(d), "path": n}
                    for n, d in files.items()]
            return self._send(handler, 200, json.dumps(tree).encode(),
                              {"Content-Type": "application/json"}, body)
        if name not in files:
            return self._send(handler, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        data = files[name]
        return self._send(handler, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{oid(data)}"',
                                               "Content-Type": "application/octet-stream"}, body)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes,
              headers: dict[str, str], body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
