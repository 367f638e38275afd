// The fixed MIG layout editor of the node admin page (accelerators.admin.MigLayoutWidget): one row
// per GPU instance (GPU, profile, start), each profile offering only the starts its catalog allows;
// every change writes the layout's JSON into the form's textarea, draws the memory slices it takes
// and asks the server to check it as saving will (POST <node>/mig-check/), showing the answer.
(function () {
  "use strict";

  var SLICES = 8;
  var CHECK_DELAY_MS = 250;

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function csrfToken() {
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function setUp(editor) {
    var gpus = JSON.parse(document.getElementById(editor.dataset.gpus).textContent);
    var textarea = document.getElementById(editor.dataset.textarea);
    if (!gpus.length || !textarea) return;
    var body = editor.querySelector(".mig-layout-rows tbody");
    var empty = editor.querySelector(".mig-layout-empty");
    var status = editor.querySelector(".mig-layout-status");
    var preview = editor.querySelector(".mig-layout-preview");
    var rows = [];
    var timer = null, asked = 0;

    function gpuOf(key) {
      return gpus.filter(function (g) { return String(g.index) === String(key) || g.device_id === String(key); })[0];
    }
    function profileOf(gpu, name) {
      return gpu.profiles.filter(function (p) { return p.name === name; })[0];
    }

    function readTextarea() {
      var layout;
      try { layout = JSON.parse(textarea.value.trim() || "{}"); } catch (e) { return false; }
      if (!layout || typeof layout !== "object" || Array.isArray(layout)) return false;
      var found = [];
      Object.keys(layout).forEach(function (key) {
        var gpu = gpuOf(key);
        (Array.isArray(layout[key]) ? layout[key] : []).forEach(function (e) {
          found.push({ gpu: gpu ? gpu.index : key, profile: String(e && e.profile || ""), start: e && e.start });
        });
      });
      rows = found;
      return true;
    }

    function layoutOf() {
      var layout = {};
      rows.forEach(function (r) {
        (layout[String(r.gpu)] = layout[String(r.gpu)] || []).push({ profile: r.profile, start: r.start });
      });
      return layout;
    }

    function option(select, value, text, selected) {
      var o = el("option", { value: String(value) }, text);
      if (selected) o.selected = true;
      select.appendChild(o);
    }

    function renderRows() {
      body.textContent = "";
      rows.forEach(function (row, i) {
        var gpu = gpuOf(row.gpu) || gpus[0];
        var tr = el("tr", { "class": "mig-row" });
        var n = i + 1;

        var gpuSelect = el("select", { "class": "mig-gpu", "aria-label": "GPU of instance " + n });
        gpus.forEach(function (g) { option(gpuSelect, g.index, "GPU " + g.index + " · " + g.model, g.index === gpu.index); });
        gpuSelect.addEventListener("change", function () { row.gpu = Number(gpuSelect.value); changed(); });

        var profileSelect = el("select", { "class": "mig-profile-select", "aria-label": "Profile of instance " + n });
        var profile = profileOf(gpu, row.profile);
        if (!profile) option(profileSelect, row.profile, row.profile ? row.profile + " (not in the catalog)" : "—", true);
        gpu.profiles.forEach(function (p) {
          option(profileSelect, p.name, p.name + " · " + p.memory + " · " + p.size + " slice" + (p.size > 1 ? "s" : ""),
                 p.name === row.profile);
        });
        profileSelect.addEventListener("change", function () {
          row.profile = profileSelect.value;
          var p = profileOf(gpu, row.profile);
          if (p && p.starts.indexOf(row.start) < 0) row.start = p.starts[0];
          changed();
        });

        var startSelect = el("select", { "class": "mig-start", "aria-label": "Start (first memory slice) of instance " + n });
        var starts = profile ? profile.starts : [];
        if (starts.indexOf(row.start) < 0) option(startSelect, row.start, row.start + " (not allowed)", true);
        starts.forEach(function (s) { option(startSelect, s, String(s), s === row.start); });
        startSelect.addEventListener("change", function () { row.start = Number(startSelect.value); changed(); });

        var span = profile ? (profile.size > 1 ? row.start + "–" + (row.start + profile.size - 1) : String(row.start)) : "?";
        var remove = el("button", { type: "button", "class": "button mig-remove", "aria-label": "Remove instance " + n }, "Remove");
        remove.addEventListener("click", function () { rows.splice(i, 1); changed(); });

        [gpuSelect, profileSelect, startSelect].forEach(function (control) {
          var td = el("td"); td.appendChild(control); tr.appendChild(td);
        });
        tr.appendChild(el("td", { "class": "mig-span" }, span));
        var last = el("td"); last.appendChild(remove); tr.appendChild(last);
        body.appendChild(tr);
      });
      empty.hidden = rows.length > 0;
    }

    function renderPreview() {
      preview.textContent = "";
      gpus.forEach(function (gpu) {
        var owners = [], starts = {};
        for (var s = 0; s < SLICES; s++) owners.push([]);
        rows.forEach(function (r) {
          if (String(r.gpu) !== String(gpu.index)) return;
          var p = profileOf(gpu, r.profile);
          if (!p || typeof r.start !== "number") return;
          starts[r.start] = true;
          for (var k = r.start; k < r.start + p.size && k < SLICES; k++) owners[k].push(p.name + "@" + r.start);
        });
        var block = el("div", { "class": "mig-gpu-picture" });
        block.appendChild(el("strong", {}, "GPU " + gpu.index + " · " + gpu.model + " — planned"));
        var table = el("table", { "class": "mig-slices" });
        var tr = el("tr");
        tr.appendChild(el("th", { scope: "row" }, "memory"));
        owners.forEach(function (held, slot) {
          var state = held.length > 1 ? "overlap" : held.length ? "planned" : "free";
          var text = held.length > 1 ? "overlap" : held.length ? held[0].split("@")[0] : "free";
          var edge = starts[slot] && slot > 0 && owners[slot - 1].length ? " mig-edge" : ""; // one begins after another
          tr.appendChild(el("td", { "class": "mig-cell mig-" + state + edge,
                                    title: "slice " + slot + ": " + (held.join(", ") || "free") }, text));
        });
        table.appendChild(tr);
        block.appendChild(table);
        preview.appendChild(block);
      });
    }

    function check() {
      var mine = ++asked;
      status.className = "mig-layout-status";
      status.textContent = "Checking…";
      fetch(editor.dataset.checkUrl, {
        method: "POST", credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
        body: JSON.stringify({ mig_layout: layoutOf() })
      }).then(function (r) { return r.json(); }).then(function (answer) {
        if (mine !== asked) return; // a later edit's answer decides
        status.className = "mig-layout-status " + (answer.ok ? "mig-ok" : "mig-problem");
        status.textContent = answer.ok ? "✓ This layout can be created on the GPUs." : answer.error;
        textarea.setAttribute("aria-invalid", answer.ok ? "false" : "true");
      }).catch(function () {
        if (mine !== asked) return;
        status.className = "mig-layout-status mig-problem";
        status.textContent = "Could not check the layout now; saving checks it.";
      });
    }

    function changed() {
      textarea.value = JSON.stringify(layoutOf());
      // Drawing the rows again keeps the keyboard where it was: the same control of the same row.
      var active = document.activeElement, place = null;
      if (active && body.contains(active)) {
        var tr = active.closest("tr");
        place = { row: Array.prototype.indexOf.call(body.children, tr), cls: active.className.split(" ").pop() };
      }
      renderRows();
      if (place) {
        var row = body.children[Math.min(place.row, body.children.length - 1)];
        var again = row && row.querySelector("." + place.cls);
        if (again) again.focus();
        else if (!row) editor.querySelector(".mig-add").focus();
      }
      renderPreview();
      clearTimeout(timer);
      timer = setTimeout(check, CHECK_DELAY_MS);
    }

    editor.querySelector(".mig-add").addEventListener("click", function () {
      var gpu = gpus[0];
      var used = {};
      rows.forEach(function (r) {
        var p = profileOf(gpuOf(r.gpu) || gpu, r.profile);
        if (String(r.gpu) === String(gpu.index) && p) for (var k = r.start; k < r.start + p.size; k++) used[k] = true;
      });
      var smallest = gpu.profiles[0];
      var start = smallest.starts.filter(function (s) { return !used[s]; })[0];
      rows.push({ gpu: gpu.index, profile: smallest.name, start: start === undefined ? smallest.starts[0] : start });
      changed();
      var selects = body.querySelectorAll(".mig-profile-select");
      if (selects.length) selects[selects.length - 1].focus();
    });

    textarea.addEventListener("input", function () {
      if (readTextarea()) { renderRows(); renderPreview(); clearTimeout(timer); timer = setTimeout(check, CHECK_DELAY_MS); }
    });

    if (!readTextarea()) {
      status.className = "mig-layout-status mig-problem";
      status.textContent = "The layout below is not valid JSON; fix it under “Edit as JSON”.";
      return;
    }
    renderRows();
    renderPreview();
    if (rows.length) check();
  }

  function start() {
    Array.prototype.forEach.call(document.querySelectorAll(".mig-layout-editor"), setUp);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
