// The fleet overview (admin › Nodes › Fleet overview): polls GET /api/v1/fleet/ with the form's
// filters every 5 s while the tab is shown, and draws the totals, the heat map (every node the
// filters keep, grouped by resource group) and one page of nodes with a strip per GPU.
// Everything an agent reports (names, models) is set as text, never as HTML.
(function () {
  "use strict";
  var POLL_MS = 5000;
  var root = document.getElementById("fleet");
  if (!root) return;
  var form = document.getElementById("fleet-filters");
  var status = document.getElementById("fleet-status");
  var BIN = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function bytes(n) {
    if (n === null || n === undefined) return "—";
    var i = 0, v = n;
    while (i < BIN.length - 1 && v >= 1024) { v /= 1024; i++; }
    return (Math.round(v * 10) / 10) + " " + BIN[i];
  }
  function bucket(load) { return "load-" + Math.min(10, Math.max(0, Math.round(load / 10))); }
  function when(iso) {
    if (!iso) return "never";
    var s = Math.round((Date.now() - Date.parse(iso)) / 1000);
    if (s < 60) return Math.max(0, s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    return Math.round(s / 3600) + " h ago";
  }
  function params() {
    var p = new URLSearchParams();
    new FormData(form).forEach(function (v, k) { if (v !== "" && !(k === "page" && v === "1")) p.set(k, v); });
    return p;
  }
  function setPage(n) { form.elements.page.value = String(n); refresh(true); }

  function stat(label, value, note) {
    var box = el("div", "fleet-stat");
    box.appendChild(el("span", "fleet-stat-label", label));
    box.appendChild(el("span", "fleet-stat-value", value));
    if (note) box.appendChild(el("span", "fleet-stat-note", note));
    return box;
  }
  function drawSummary(d) {
    var t = d.totals, box = document.getElementById("fleet-summary");
    var states = Object.keys(d.states).filter(function (k) { return d.states[k]; })
      .map(function (k) { return d.states[k] + " " + k; }).join(" · ") || "none";
    box.replaceChildren(
      stat("Nodes shown", t.nodes + " of " + Object.values(d.states).reduce(function (a, b) { return a + b; }, 0), states),
      stat("GPUs", t.gpus, t.gpus_idle + " idle" + (t.mig_gpus ? " · " + t.mig_gpus + " MIG" : "")),
      stat("fGPU free", t.fgpu_free + " of " + t.fgpu_capacity, t.fgpu_allocated + " allocated"),
      stat("GPU memory allocated", bytes(t.memory_allocated), "of " + bytes(t.memory_total)),
      stat("Used now", d.used.util === null ? "—" : d.used.util + " % util",
           bytes(d.used.memory_used) + " on " + d.used.gpus_sampled + " sampled GPU" + (d.used.gpus_sampled === 1 ? "" : "s")),
      stat("MIG slices free", t.mig_total ? t.mig_free + " of " + t.mig_total : "—", "compute slices, 7 a GPU"),
      stat("Allocated", t.load + " %", t.sessions + " live allocation" + (t.sessions === 1 ? "" : "s"))
    );
  }
  function drawHeat(d) {
    var box = document.getElementById("fleet-heat"), groups = {}, order = [];
    d.heat.forEach(function (n) {
      var g = n.resource_group || "(no group)";
      if (!groups[g]) { groups[g] = []; order.push(g); }
      groups[g].push(n);
    });
    order.sort();
    var parts = order.map(function (g) {
      var sec = el("section", "fleet-heat-group");
      var loads = groups[g].map(function (n) { return n.load; });
      var mean = Math.round(loads.reduce(function (a, b) { return a + b; }, 0) / loads.length);
      sec.appendChild(el("h3", "", g + " — " + groups[g].length + " node" + (groups[g].length === 1 ? "" : "s") + ", " + mean + " % allocated"));
      var grid = el("div", "fleet-heat-grid");
      groups[g].forEach(function (n) {
        var mark = { ready: "", lost: " is-lost", draining: " is-draining" }[n.state];
        var a = el("a", "fleet-cell " + bucket(n.load) + (mark === undefined ? " is-mig" : mark));
        a.href = "?name=" + encodeURIComponent(n.name);
        var label = n.name + ": " + n.state + ", " + n.load + " % allocated, " + n.fgpu_free + " fGPU free, " +
          n.gpus_idle + " idle GPU" + (n.gpus_idle === 1 ? "" : "s") + (n.mig_free ? ", " + n.mig_free + " free MIG slices" : "");
        a.title = label;
        a.setAttribute("aria-label", label);
        a.tabIndex = -1;  // a thousand cells are no tab stops: the table below and the filters serve the keyboard
        a.addEventListener("click", function (ev) {
          ev.preventDefault();
          form.elements.name.value = n.name;
          setPage(1);
        });
        grid.appendChild(a);
      });
      sec.appendChild(grid);
      return sec;
    });
    if (!parts.length) parts = [el("p", "help", "No node matches these filters.")];
    box.replaceChildren.apply(box, parts);
  }
  function gpuStrip(node) {
    var strip = el("div", "fleet-gpus");
    node.gpus.forEach(function (g) {
      var cell = el("span", "fleet-gpu " + bucket(g.load) + (g.kind === "mig" ? " is-mig-gpu" : ""));
      var used = g.used && g.used.util !== null ? g.used.util : null;
      var fill = el("span", "fleet-gpu-used");
      if (g.used) fill.style.height = Math.min(100, Math.round(100 * g.used.memory_used / g.memory_size)) + "%";
      cell.appendChild(fill);
      var text = "#" + g.index + " " + g.model + ": " + g.load + " % allocated";
      if (g.kind === "fgpu") text += ", " + g.free_fgpu + " of " + g.capacity_fgpu + " fGPU free";
      if (g.kind === "mig") text += ", MIG " + (g.mig_total - g.mig_used) + " of " + g.mig_total + " slices free";
      text += g.used ? "; uses " + bytes(g.used.memory_used) + (used === null ? "" : ", " + used + " % util") : "; no recent sample";
      cell.title = text;
      cell.setAttribute("role", "img");
      cell.setAttribute("aria-label", text);
      strip.appendChild(cell);
    });
    return strip;
  }
  function drawTable(d) {
    var body = document.querySelector("#fleet-table tbody"), base = root.dataset.nodeUrl;
    var rows = d.nodes.map(function (n) {
      var tr = el("tr", n.state === "lost" ? "fleet-row-lost" : "");
      var th = el("th", ""); th.scope = "row";
      var a = el("a", "", n.name); a.href = base + n.id + "/change/"; th.appendChild(a);
      tr.appendChild(th);
      var st = el("td", ""); st.appendChild(el("span", "fleet-state fleet-state-" + n.state, n.state)); tr.appendChild(st);
      tr.appendChild(el("td", "", n.resource_group || "—"));
      var gpus = el("td", ""); gpus.appendChild(gpuStrip(n)); tr.appendChild(gpus);
      var alloc = el("td", "fleet-num-col");
      var bar = el("div", "fleet-bar"); var fill = el("span", bucket(n.load)); fill.style.width = n.load + "%"; bar.appendChild(fill);
      alloc.appendChild(bar); alloc.appendChild(el("span", "", n.load + " % · " + bytes(n.memory_allocated)));
      tr.appendChild(alloc);
      var sampled = n.gpus.filter(function (g) { return g.used; });
      var utils = sampled.filter(function (g) { return g.used.util !== null; }).map(function (g) { return g.used.util; });
      var mem = sampled.reduce(function (s, g) { return s + g.used.memory_used; }, 0);
      tr.appendChild(el("td", "fleet-num-col", sampled.length ? (utils.length ? Math.round(utils.reduce(function (a, b) { return a + b; }, 0) / utils.length) + " % · " : "") + bytes(mem) : "no sample"));
      var free = [];
      if (n.fgpu_capacity !== "0.00") free.push(n.fgpu_free + " / " + n.fgpu_capacity + " fGPU");
      free.push(n.gpus_idle + " idle GPU" + (n.gpus_idle === 1 ? "" : "s"));
      if (n.mig_total) free.push(n.mig_free + " / " + n.mig_total + " MIG slices");
      tr.appendChild(el("td", "", free.join(" · ")));
      tr.appendChild(el("td", "fleet-num-col", n.sessions));
      tr.appendChild(el("td", "", when(n.last_heartbeat)));
      return tr;
    });
    if (!rows.length) { var tr = el("tr"); var td = el("td", "help", "No node matches these filters."); td.colSpan = 9; tr.appendChild(td); rows = [tr]; }
    body.replaceChildren.apply(body, rows);
  }
  function drawPager(d) {
    ["fleet-pager-top", "fleet-pager"].forEach(function (id) {
      var nav = document.getElementById(id), parts = [];
      function button(text, page, disabled) {
        var b = el("button", "button", text); b.type = "button"; b.disabled = disabled;
        b.addEventListener("click", function () { setPage(page); });
        return b;
      }
      parts.push(button("‹ Previous", d.page - 1, d.page <= 1));
      parts.push(el("span", "fleet-page-of", "Page " + d.page + " of " + d.pages + " · " + d.count + " node" + (d.count === 1 ? "" : "s")));
      parts.push(button("Next ›", d.page + 1, d.page >= d.pages));
      nav.replaceChildren.apply(nav, parts);
    });
  }

  var timer = null, running = false, seq = 0;
  function refresh(now) {
    if (timer) { clearTimeout(timer); timer = null; }
    if (running && !now) return;
    running = true;
    var mine = ++seq;  // a newer refresh (the filters changed) wins: an older answer is dropped
    var p = params();
    history.replaceState(null, "", "?" + p.toString());
    var started = performance.now();
    fetch(root.dataset.api + "?" + p.toString(), { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) throw new Error(body.detail || ("HTTP " + r.status));
          return body;
        });
      })
      .then(function (d) {
        if (mine !== seq) return;
        form.elements.page.value = String(d.page);
        drawSummary(d); drawHeat(d); drawTable(d); drawPager(d);
        root.dataset.loaded = "true";
        status.textContent = "Updated " + new Date().toLocaleTimeString() + " (" + Math.round(performance.now() - started) + " ms).";
        status.classList.remove("fleet-stale");
      })
      .catch(function (e) {
        if (mine !== seq) return;
        status.textContent = "Could not update: " + e.message + ". Showing the last figures.";
        status.classList.add("fleet-stale");
      })
      .then(function () {
        if (mine !== seq) return;
        running = false;
        if (!document.hidden) timer = setTimeout(refresh, POLL_MS);
      });
  }
  form.addEventListener("submit", function (ev) { ev.preventDefault(); form.elements.page.value = "1"; refresh(true); });
  form.addEventListener("change", function (ev) {
    if (ev.target.tagName === "SELECT") { form.elements.page.value = "1"; refresh(true); }
  });
  document.addEventListener("visibilitychange", function () { if (!document.hidden && !timer && !running) refresh(); });
  refresh(true);
})();
