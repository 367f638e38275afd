// "My resources" on the sessions page (issue 18.1): the user's fGPU, GPU memory and sessions in
// use against the quota that binds each, the GPU capacity free by resource group, and their data
// folders' storage per node against its limit (issue 31). Drawn from
// the page's JSON, then again from GET /api/v1/my-resources/ whenever the sessions table changes
// (a launch, a notice, a terminate). No build step; uses console.js's window.fgpu.api.
(function () {
  "use strict";

  var panel = document.getElementById("my-resources");
  if (!panel) return;
  var url = panel.getAttribute("data-url");
  var LABELS = { fgpu: "fGPU", gpu_memory: "GPU memory", sessions: "Sessions" };

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { node.appendChild(c); });
    return node;
  }

  function gib(bytes) {
    var n = Number(bytes) / 1073741824;
    return (n >= 100 ? n.toFixed(0) : n.toFixed(n % 1 ? 2 : 0)) + " GiB";
  }

  function figure(key, value) {
    if (value === null || value === undefined) return "";
    if (key === "gpu_memory") return gib(value);
    if (key === "fgpu") return value + " fGPU";
    return String(value);
  }

  // 0–100: how full the quota is (none: no bar).
  function percent(used, limit) {
    var u = Number(used), l = Number(limit);
    if (!(l > 0)) return used > 0 ? 100 : 0;
    return Math.max(0, Math.min(100, u / l * 100));
  }

  // One figure of the panel: its label and text, and where `meter` is given ({pct, full, note}) a
  // meter of how full it is with a note below.
  function figureItem(attrs, label, text, meter) {
    var item = el("li", Object.assign({ "class": "resources-figure" }, attrs));
    item.appendChild(el("div", { "class": "resources-figure-head" }, [
      el("span", { "class": "resources-label", text: label }),
      el("span", { "class": "resources-value", text: text }),
    ]));
    if (!meter) return item;
    var bar = el("div", { "class": "meter" + (meter.full ? " meter-full" : ""), role: "meter", "aria-label": label + " in use",
                          "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": String(Math.round(meter.pct)),
                          "aria-valuetext": text });
    var fill = el("span", { "class": "meter-fill" });
    fill.style.width = meter.pct + "%";
    bar.appendChild(fill);
    item.appendChild(bar);
    item.appendChild(el("p", { "class": "resources-source small" + (meter.full ? " resources-full" : ""), text: meter.note }));
    return item;
  }

  function usageItem(f) {
    var limited = f.limit !== null && f.limit !== undefined;
    var text = limited ? figure(f.key, f.used) + " of " + figure(f.key, f.limit) : figure(f.key, f.used) + " · no quota";
    var full = limited && Number(f.left) <= 0;
    return figureItem({ "data-key": f.key }, LABELS[f.key] || f.key, text, limited && {
      pct: percent(f.used, f.limit), full: full,
      note: (full ? "none left · " : figure(f.key, f.left) + " left · ") + "capped by " + f.quota });
  }

  // A data folder on one node (the API's storage rows): "~/data on node-1", "1.2 GiB of 10 GiB".
  function folderItem(f) {
    var pct = percent(f.used, f.limit);
    var near = pct >= 90;
    return figureItem({ "data-folder": f.folder, "data-node": f.node }, f.folder + " on " + f.node,
      size(f.used) + " of " + size(f.limit), { pct: pct, full: near,
      note: "measured " + new Date(f.t * 1000).toLocaleString() + (near ? " · sessions that mount it stop past the limit" : "") });
  }

  // 1288490188 -> "1.2 GiB", 524288000 -> "500 MiB" (binary units, one decimal).
  function size(bytes) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], v = Number(bytes), i = 0;
    while (i < units.length - 1 && v >= 1024) { v /= 1024; i++; }
    return (i && v < 100 ? v.toFixed(1).replace(/\.0$/, "") : Math.round(v)) + " " + units[i];
  }

  // "3.50 of 4.00 fGPU", and the GPUs that serve MIG instead by their compute slices:
  // "3.50 of 4.00 fGPU · 5 of 7 MIG slices (1 GPU)"; only the MIG part where no GPU serves fGPU.
  function gpuFree(g) {
    var unit = g.allocation_mode === "discrete" ? " GPUs" : " fGPU";
    var parts = [];
    if (Number(g.total) > 0 || !g.mig_gpus) parts.push(g.free + " of " + g.total + unit);
    if (g.mig_gpus) parts.push(g.mig_free + " of " + g.mig_total + " MIG slices (" + g.mig_gpus + (g.mig_gpus === 1 ? " GPU)" : " GPUs)"));
    return parts.join(" · ");
  }

  function groupRow(g) {
    return el("tr", {}, [
      el("th", { scope: "row", text: g.name || "Any node" }),
      el("td", { "data-label": "Nodes alive", text: g.nodes_alive + " of " + g.nodes + (g.nodes_alive < g.nodes ? " (" + (g.nodes - g.nodes_alive) + " lost)" : "") }),
      el("td", { "class": "num", "data-label": "GPU free", text: gpuFree(g) }),
      el("td", { "class": "num", "data-label": "GPU memory free", text: gib(g.memory_free) + " of " + gib(g.memory_total) }),
    ]);
  }

  function render(data) {
    if (!data) return;
    var list = document.getElementById("resources-usage");
    list.textContent = "";
    (data.usage || []).forEach(function (f) { list.appendChild(usageItem(f)); });
    var body = document.getElementById("resources-groups").tBodies[0];
    body.textContent = "";
    (data.groups || []).forEach(function (g) { body.appendChild(groupRow(g)); });
    var folders = document.getElementById("resources-storage");
    folders.textContent = "";
    (data.storage || []).forEach(function (f) { folders.appendChild(folderItem(f)); });
    document.getElementById("resources-storage-section").hidden = !(data.storage || []).length;
  }

  var timer = null;
  function refresh() {
    window.fgpu.api("GET", url).then(function (r) { if (r.ok) render(r.data); }).catch(function () {});
  }
  function soon() { clearTimeout(timer); timer = setTimeout(refresh, 300); }

  var initial = document.getElementById("my-resources-data");
  render(initial ? JSON.parse(initial.textContent) : null);
  var rows = document.querySelector("#sessions-table tbody");
  if (rows && window.MutationObserver) new MutationObserver(soon).observe(rows, { childList: true });
  document.addEventListener("visibilitychange", function () { if (!document.hidden) soon(); });
})();
