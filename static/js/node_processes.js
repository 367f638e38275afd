// The node admin page's "Processes on its GPUs" (issue 16): what holds the node's GPUs now, as
// its agent sees them (NVML's running processes; a mock node: each session's declared use, else
// its granted slice), from GET /api/v1/nodes/<name>/processes/ (#node-processes data-url),
// asked as the page opens and again every POLL_MS while the tab is visible. Built with DOM nodes, never innerHTML:
// commands are other users' text.
(function () {
  "use strict";

  var POLL_MS = 5000;
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
  var box = null;

  // 2147483648 -> "2 GiB" (binary units, at most two decimals); null -> "—".
  function bytesText(bytes) {
    if (bytes === null || bytes === undefined) return "—";
    var i = 0, v = bytes;
    while (i < UNITS.length - 1 && v >= 1024) { v /= 1024; i++; }
    return (Math.round(v * 100) / 100) + " " + UNITS[i];
  }

  function cell(row, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  function render(data) {
    var note = document.createElement("p");
    note.className = "help";
    var when = data.at ? new Date(data.at * 1000).toLocaleTimeString() : "now";
    note.textContent = (data.source === "nvml" ? "NVML's running processes" :
      "a mock node: each session's declared use, else its granted slice") + ", read at " + when +
      (data.truncated ? " (the first 2000)" : "") + ".";
    if (!data.processes.length) {
      var none = document.createElement("p");
      none.textContent = "No process holds any of its GPUs.";
      box.replaceChildren(none, note);
      return;
    }
    var table = document.createElement("table");
    table.className = "node-processes";
    var head = table.createTHead().insertRow();
    ["GPU", "PID", "Session", "Owner", "GPU memory", "Granted", "Kind", "Command"].forEach(function (h) {
      var th = document.createElement("th");
      th.textContent = h;
      th.scope = "col";
      head.appendChild(th);
    });
    var body = table.createTBody();
    data.processes.forEach(function (p) {
      var row = body.insertRow();
      row.dataset.pid = p.pid;
      cell(row, (p.index === null ? "?" : p.index) + " · " + (p.model_name || p.device), "");
      cell(row, String(p.pid), "");
      cell(row, p.session ? p.session.name : "— (no session)", "");
      cell(row, p.session ? p.session.owner : "—", "");
      cell(row, bytesText(p.memory), "memory");
      cell(row, p.session ? bytesText(p.session.granted_memory) : "—", "");
      cell(row, p.kind, "");
      cell(row, p.command || "?", "command");
    });
    box.replaceChildren(table, note);
  }

  function tick(always) {
    if (document.hidden && !always) return;
    fetch(box.dataset.url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) throw new Error(body.detail || ("HTTP " + r.status));
          return body;
        });
      })
      .then(render)
      .catch(function (err) {
        var p = document.createElement("p");
        p.className = "errornote";
        p.textContent = "Could not ask the agent: " + err.message;
        box.replaceChildren(p);
      });
  }

  function start() {
    box = document.getElementById("node-processes");
    if (!box) return;
    tick(true); // once as the page opens, even in a background tab
    setInterval(tick, POLL_MS);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) tick(); });
  }

  // The admin loads its media in <head>: the element exists once the document is parsed.
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
