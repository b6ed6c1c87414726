"""The error reporter injected into HTML the preview serves, and where it is put.

The script reports ``window.onerror``, unhandled promise rejections and
``console.error`` as ``RuntimeErrorReport`` JSON to ``<prefix>__sandcell/runtime-errors``,
a path under the same prefix the page was served from, so the report is
same-origin through whatever proxy sits in front (the orchestrator's
``/preview/<id>/``) and needs no CORS. It sends at most 50 reports per page load,
cuts long messages and stacks to what the runner accepts, and never throws.

Unless the proxy says the app reloads itself (``X-Sandcell-Live-Reload: 0``), a
second script polls ``<prefix>__sandcell/changes`` and reloads the page when a
file was written or removed through the session's file routes since it loaded.
"""

from __future__ import annotations

import json
import re

from sandcell_protocol.app_messages import BROWSER_ERRORS_PATH, PREVIEW_CHANGES_PATH

# A path of URL-safe characters, starting and ending with "/"; anything else in
# X-Forwarded-Prefix is ignored (it ends up inside a <script>).
_PREFIX_RE = re.compile(r"/(?:[A-Za-z0-9._~!$&'()*+,;=:@%-]+/)*")
_HEAD_CLOSE_RE = re.compile(rb"</head\s*>", re.IGNORECASE)
_BODY_OPEN_RE = re.compile(rb"<body(?:\s[^>]*)?>", re.IGNORECASE)
_HTML_OPEN_RE = re.compile(rb"<html(?:\s[^>]*)?>", re.IGNORECASE)

_SCRIPT = """(function(){
if (window.__sandcellReporter) return; window.__sandcellReporter = true;
var url = %s, left = 50;
function cut(v, n) { v = v == null ? "" : String(v); return v.length > n ? v.slice(0, n) : v; }
function send(r) {
  if (left <= 0) return; left--;
  try {
    fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(r), keepalive: true, credentials: "same-origin"})
      .catch(function(){});
  } catch (e) {}
}
function report(type, message, stack, src, line, col) {
  send({type: cut(type || "Error", 200), message: cut(message, 16000),
    stack: stack ? cut(stack, 60000) : null, url: src ? cut(src, 4000) : null,
    line: line > 0 ? line : null, column: col > 0 ? col : null});
}
window.addEventListener("error", function(e) {
  var err = e.error;
  report(err && err.name, e.message || (err && err.message) || String(err),
    err && err.stack, e.filename || location.href, e.lineno, e.colno);
});
window.addEventListener("unhandledrejection", function(e) {
  var r = e.reason, isErr = r && typeof r === "object" && "message" in r;
  report(isErr ? r.name : "UnhandledRejection", isErr ? r.message : String(r),
    isErr ? r.stack : null, location.href, 0, 0);
});
var original = console.error;
console.error = function() {
  try {
    var args = Array.prototype.slice.call(arguments), err = null;
    for (var i = 0; i < args.length; i++) if (args[i] instanceof Error) { err = args[i]; break; }
    report(err ? err.name : "ConsoleError", args.map(function(a) {
      return a instanceof Error ? a.message : typeof a === "object" ? safe(a) : String(a);
    }).join(" "), err && err.stack, location.href, 0, 0);
  } catch (e) {}
  return original.apply(this, arguments);
};
function safe(a) { try { return JSON.stringify(a); } catch (e) { return String(a); } }
})();"""


# Live reload for apps without their own: poll the session's file-change counter
# (about once a second while the tab is visible) and reload when it moves. The page
# starts from the counter it was served at, not from its first poll's answer: a
# write between serving and that answer would otherwise never reload the tab.
_RELOAD = """(function(){
if (window.__sandcellReload) return; window.__sandcellReload = true;
var url = %s, seen = %d;
function poll() {
  if (document.hidden) return;
  fetch(url, {cache: "no-store", credentials: "same-origin"})
    .then(function(r) { return r.ok ? r.json() : null; })
    .then(function(v) {
      if (!v || typeof v.version !== "number") return;
      if (v.version !== seen) location.reload();
    }).catch(function(){});
}
poll(); setInterval(poll, 1000);
})();"""


def reporter_prefix(forwarded: str | None, port: int) -> str:
    """``X-Forwarded-Prefix`` when it is a plain path ending in ``/``, else the port's own."""
    if forwarded is not None and len(forwarded) <= 512 and _PREFIX_RE.fullmatch(forwarded):
        return forwarded
    return f"/v1/session/ports/{port}/"


def reporter_tag(prefix: str, *, files_version: int | None = None) -> bytes:
    """The ``<script>`` element posting to ``prefix`` (JSON-quoted, ``<`` escaped), with
    the live-reload poller when ``files_version`` (the file-change counter when the
    page was requested) is given, that is unless the app reloads its pages itself."""
    target = json.dumps(prefix + BROWSER_ERRORS_PATH).replace("<", "\\u003c")
    script = _SCRIPT % target
    if files_version is not None:
        changes = json.dumps(prefix + PREVIEW_CHANGES_PATH).replace("<", "\\u003c")
        script += _RELOAD % (changes, files_version)
    return b"<script>" + script.encode() + b"</script>"


def inject(html: bytes, tag: bytes) -> bytes:
    """``tag`` before ``</head>``, else after ``<body…>``, else after ``<html…>``, else first."""
    if match := _HEAD_CLOSE_RE.search(html):
        return html[: match.start()] + tag + html[match.start() :]
    for pattern in (_BODY_OPEN_RE, _HTML_OPEN_RE):
        if match := pattern.search(html):
            return html[: match.end()] + tag + html[match.end() :]
    return tag + html


__all__ = ["inject", "reporter_prefix", "reporter_tag"]
