"""The read-only status page of `dsml status --serve` (runtime).

`StatusPoller` asks the registry for its status every `interval` seconds, in a thread of
its own, and keeps the latest reply and the last minute of each rank's median time split.
`serve` puts an HTTP server (stdlib `http.server`) in front of it with three paths:

- `/`: the page: the group (epoch, world size), a row per rank with the collective it is
  in, whom it waits for, who waits for it (a stuck rank's row is marked: class `stuck`;
  a straggler's: class `straggler`),
  its heartbeat's age, calls per second and median time split; a small plot per rank of
  that split over the last minute; the recent view changes with why; it reloads itself;
- `/status.json`: the registry's last reply as it came, with the stuck and straggling
  ranks under `"marks"` (dsml/status_view.py `with_marks`);
- anything else: 404. Only GET and HEAD are served; the page runs no script.

It binds loopback unless told otherwise, like everything in dsml, and `dsml status`
serves it behind the job secret: under a path made of an HMAC of the secret
(`/<token>/`, `/<token>/status.json`), printed when it starts, so only a holder of the
secret can find it (`page_token`); any other path is 404.
"""

from __future__ import annotations

import asyncio
import collections
import html
import http.server
import json
import socket
import threading
import time
from typing import Any

from .errors import DsmlError
from .membership import query_status
from .status_view import PARTS, Row, rows, with_marks
from .transport import JobSecret

__all__ = ["StatusPoller", "page", "page_token", "serve"]

HISTORY_S = 60.0  # the plot's span
_POLICY = "default-src 'none'; style-src 'unsafe-inline'"  # no script, nothing fetched
_COLOURS = {"waiting": "#d9534f", "wire": "#f0ad4e", "reduce": "#5bc0de", "copy": "#5cb85c"}
_COLOURS["other"] = "#999999"


class StatusPoller:
    """Polls a registry from a thread; `latest()` is its last reply (or error)."""

    def __init__(self, address: str, interval: float, wait: float, curve: Any = None) -> None:
        self.address = address
        self.interval = interval
        self._wait = wait
        self._curve = curve
        self._lock = threading.Lock()
        self._status: dict[str, Any] = {}
        self._error = "no answer yet"
        self._at = 0.0
        #: rank -> (time.time(), p50 seconds per part) over the last HISTORY_S
        self._history: dict[int, collections.deque[tuple[float, dict[str, float]]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsml-status-poll", daemon=True)

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._wait + self.interval + 1.0)

    def latest(self) -> tuple[dict[str, Any], str, float, dict[int, list[Any]]]:
        """(last reply, error of the last poll or "", when it came, split history)."""
        with self._lock:
            history = {rank: list(h) for rank, h in self._history.items()}
            return self._status, self._error, self._at, history

    def _run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status = await query_status(
                    self.address, registry_timeout=self._wait, curve=self._curve
                )
            except DsmlError as exc:
                with self._lock:
                    self._error = str(exc)
            else:
                self._took(status)
            await asyncio.to_thread(self._stop.wait, self.interval)

    def _took(self, status: dict[str, Any]) -> None:
        now = time.time()
        with self._lock:
            self._status, self._error, self._at = status, "", now
            for row in rows(status):
                if row.p50_s is not None:
                    history = self._history.setdefault(row.rank, collections.deque())
                    history.append((now, row.p50_s))
            for history in self._history.values():
                while history and history[0][0] < now - HISTORY_S:
                    history.popleft()

    def __repr__(self) -> str:
        return f"<StatusPoller {self.address} every {self.interval:g} s>"


def page_token(secret: JobSecret) -> str:
    """The path under which `dsml status --serve` shows the job: derived from the secret,
    so the same on every start and unknown to whoever does not hold it."""
    return secret.password(b"dsml-status-page").decode()[:32]


def serve(
    poller: StatusPoller, host: str, port: int, token: str = ""
) -> http.server.ThreadingHTTPServer:
    """An HTTP server of the page on (host, port) (port 0: any); call `serve_forever()`.

    With `token`, the page is at `/<token>/` and its data at `/<token>/status.json`."""
    root = f"/{token}/" if token else "/"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            status, error, at, history = poller.latest()
            if path == root:
                body = page(poller.address, status, error, at, history, poller.interval)
                kind = "text/html; charset=utf-8"
            elif path == root + "status.json":
                body, kind = json.dumps(with_marks(status), indent=1), "application/json"
            else:
                self.send_error(404, "not found (the page is /, its data /status.json)")
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", _POLICY)
            self.end_headers()
            if send_body:
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per reload would drown the terminal

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True  # a browser's kept-alive connection does not hold the exit

    return Server((host, port), Handler)


def page(
    address: str,
    status: dict[str, Any],
    error: str,
    at: float,
    history: dict[int, list[Any]],
    refresh_s: float,
) -> str:
    """The page's HTML (every value from the registry escaped)."""
    e = html.escape
    table = rows(status)
    stuck = [r.rank for r in table if r.stuck]
    slow = [r.rank for r in table if r.straggler]
    when = time.strftime("%H:%M:%S", time.localtime(at)) if at else "never"
    head = f"registry {e(address)}, asked at {when}"
    if error:
        head += f" <span class='error'>(last poll failed: {e(error)})</span>"
    group = (
        f"epoch {e(str(status.get('epoch')))}, world size {e(str(status.get('world_size')))}, "
        f"{'formed' if status.get('formed') else 'not formed'}"
    )
    verdict = "<p id='verdict'>no rank is waited for</p>"
    if stuck:
        verdict = f"<p id='verdict' class='stuck'>stuck: {_ranks(stuck)}</p>"
    elif slow:
        verdict = f"<p id='verdict' class='straggler'>straggler: {_ranks(slow)}</p>"
    return "\n".join(
        [
            "<!doctype html>",
            "<html><head><meta charset='utf-8'>",
            f"<meta http-equiv='refresh' content='{max(1, round(refresh_s))}'>",
            f"<title>dsml status: {e(address)}</title>",
            f"<style>{_STYLE}</style></head><body>",
            f"<h1>dsml job</h1><p>{head}</p><p id='group'>{group}</p>",
            verdict,
            _rank_table(table, history),
            _legend(),
            _views(status.get("views") or []),
            "</body></html>",
        ]
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def _rank_table(table: list[Row], history: dict[int, list[Any]]) -> str:
    e = html.escape
    out = [
        "<table id='ranks'><tr><th>rank</th><th>member</th><th>host:pid</th><th>epoch</th>"
        "<th>heartbeat</th><th>collective now</th><th>waits for</th><th>waited for by</th>"
        "<th>calls/s</th><th>p50 ms (total / waiting / wire / reduce / copy / other)</th>"
        "<th>last minute</th></tr>"
    ]
    for row in table:
        beat = f"{row.beat_s:.1f} s ago" if row.beat_s is not None else "-"
        rate = f"{row.calls_per_s:.1f}" if row.calls_per_s is not None else "-"
        split = " / ".join(f"{row.p50_s[p] * 1e3:.2f}" for p in PARTS) if row.p50_s else "-"
        by = e(row.mark()) or "-"
        state = "stuck" if row.stuck else "straggler" if row.straggler else "ok"
        out.append(
            f"<tr id='rank-{row.rank}' class='{state}' "
            f"data-stuck='{'true' if row.stuck else 'false'}'>"
            f"<td>{row.rank}</td><td>{e(row.member)}</td><td>{e(row.where)}</td>"
            f"<td>{row.epoch}</td><td>{beat}</td><td>{e(row.doing())}</td>"
            f"<td>{e(', '.join(map(str, row.waits_for))) or '-'}</td><td>{by}</td>"
            f"<td>{rate}</td><td>{split}</td><td>{_plot(history.get(row.rank, []))}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _plot(samples: list[tuple[float, dict[str, float]]]) -> str:
    """Stacked bars of a rank's median time split over the last minute (an inline SVG)."""
    width, height = 180, 28
    if not samples:
        return "-"
    now = samples[-1][0]
    top = max(s["total"] for _, s in samples) or 1.0
    bars = []
    for t, split in samples:
        x = width - (now - t) / HISTORY_S * width
        y = float(height)
        for part in PARTS[1:]:
            h = split[part] / top * height
            if h > 0:
                y -= h
                bars.append(
                    f"<rect x='{x - 3:.1f}' y='{y:.1f}' width='3' height='{h:.1f}' "
                    f"fill='{_COLOURS[part]}'/>"
                )
    return (
        f"<svg width='{width}' height='{height}' role='img' "
        f"aria-label='median time split, last minute (top: {top * 1e3:.2f} ms)'>"
        + "".join(bars)
        + "</svg>"
    )


def _legend() -> str:
    keys = "".join(
        f"<span class='key' style='background:{c}'></span>{p} " for p, c in _COLOURS.items()
    )
    return f"<p class='legend'>last minute, per poll: {keys}(scaled to each rank's slowest)</p>"


def _views(views: list[dict[str, Any]]) -> str:
    e = html.escape
    out = ["<h2>recent view changes</h2><table id='views'>"]
    out.append("<tr><th>epoch</th><th>at</th><th>members</th><th>why</th></tr>")
    for v in reversed(views):
        at = time.strftime("%H:%M:%S", time.localtime(v.get("at", 0)))
        out.append(
            f"<tr><td>{e(str(v.get('epoch')))}</td><td>{at}</td>"
            f"<td>{e(str(v.get('size')))}</td><td>{e(str(v.get('reason')))}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.9em; }
th { background: #f4f4f4; }
tr.stuck td { background: #fbe3e3; font-weight: bold; }
tr.stuck td:first-child::before { content: "\\26A0  "; color: #c9302c; }
p.stuck { color: #c9302c; font-weight: bold; }
tr.straggler td { background: #fcf3d9; }
p.straggler { color: #8a6d3b; font-weight: bold; }
.error { color: #c9302c; }
.key { display: inline-block; width: 0.8em; height: 0.8em; margin: 0 0.2em 0 0.6em; }
"""
